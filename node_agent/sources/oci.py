"""oci:// sources: an ORAS artifact in an OCI registry whose two layers are the adapter's files.

``oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]`` is read by
`lorafleet_common.storage.parse_oci_uri`, the rule the operator applies too, and must lie under
an ``--allow-source oci://REGISTRY[/REPOSITORY-PREFIX]`` entry. The manifest is fetched once, by
the digest given or else by the tag, and the sha256 of its bytes is the digest the source is
pinned to: a digest given must match it, and the layers are fetched by the digests this
manifest names, so a tag moved meanwhile changes nothing; the digest is the source's
`revision`. The manifest must be an OCI image manifest (or Docker's v2) whose layers are
exactly ``adapter_config.json`` and ``adapter_model.safetensors``, named by their
``org.opencontainers.image.title`` annotations (as ``oras push`` writes them): any other layer
(a pickle file above all) is refused, and so is a layer declared over its cap. An image whose
layers are all tar layers (as KAITO ships adapters) is accepted too: the two files are read out
of its layers (`image_layers`). Every blob is checked against its descriptor's size and sha256
before the agent uses it.

Requests go through the agent's own checked downloader (`downloads`): addresses checked against
the SSRF rules, redirects (a registry's blob storage) only under an http(s) ``--allow-source``
prefix, caps, deadline, minimum rate, progress. A registry is spoken to over https, or plain
HTTP when the fleet's owner names it with ``--oci-plain-http``. Requests start anonymous; a
registry's challenge is answered with the load's credential (`registry_auth`: a pull token from
its token service, or HTTP basic), never sent on a redirect. Messages never repeat what the
registry sent.

`resolve_oci` (ResolveSource: the operator's resolution of a tag before its loads) takes the
same steps up to the manifest's checks and answers its digest, fetching no layer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lorafleet_common.sources import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS
from lorafleet_common.storage import OciSource, parse_oci_uri
from node_agent.errors import SourceRefused
from node_agent.sources.copies import MAX_CONFIG_BYTES, ResolvedSource, Written
from node_agent.sources.credentials import SourceCredential
from node_agent.sources.downloads import Download, check_downloaded_config, check_downloaded_weights, fetching, probing
from node_agent.sources.image_layers import IMAGE_LAYER_TYPES, PICKLE_SUFFIXES, unpack_adapter
from node_agent.sources.policy import SourcePolicy, admit_storage_source
from node_agent.sources.registry_auth import RegistryAuth

log = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
TITLE_ANNOTATION = "org.opencontainers.image.title"
MAX_MANIFEST_BYTES = 4 << 20  # the distribution spec's own suggested limit
_MANIFEST_FILE = ".manifest.json"  # read, then removed: the ranks see only the adapter's files


@dataclass(frozen=True)
class Layer:
    """One layer of the artifact as its manifest describes it: the adapter file it is, or for an
    image's tar layer the name it is fetched to (then unpacked and removed)."""

    filename: str
    digest: str
    size: int


def download_oci(uri: str, download: Download, credential: SourceCredential | None, pinned: str = "") -> ResolvedSource:
    """A private copy of the adapter an oci:// URI names, pinned to its manifest's digest;
    `credential` answers the registry's challenge, if it makes one (`registry_auth`). A `pinned`
    digest (the one a tag was first resolved to) is what the tag must still name: a tag moved
    since is refused (`tag_moved`) before any layer is fetched."""
    policy, shown = download.policy, download.shown
    source = admit_storage_source(uri, policy, shown, parse_oci_uri, "oci://REGISTRY/REPOSITORY")
    base = registry_base(policy, source)
    with fetching(download) as fetcher:
        auth = RegistryAuth(fetcher, credential, source.registry, source.repository, shown)
        digest, (layers, image) = _manifest(auth, base, source, pinned)
        if image:
            for layer in layers:
                _blob(auth, base, layer, _cap(layer, _layer_cap(layer, image, policy), shown))
            written = unpack_adapter(
                fetcher.directory, [fetcher.directory / layer.filename for layer in layers], policy.max_download_bytes, shown
            )
        else:
            written = {layer.filename: _blob(auth, base, layer, _cap(layer, _layer_cap(layer, image, policy), shown)) for layer in layers}
        check_downloaded_config(fetcher.directory, shown)
        check_downloaded_weights(fetcher.directory / ADAPTER_WEIGHTS, shown)
    log.debug("downloaded %s (manifest %s)", shown, digest)
    return ResolvedSource.of_copy(
        uri, fetcher.directory, written[ADAPTER_WEIGHTS], written[ADAPTER_CONFIG], downloaded=True, revision=digest
    )


def resolve_oci(uri: str, download: Download, credential: SourceCredential | None) -> str:
    """The manifest digest an oci:// URI names now (a tag resolved, a digest checked), under
    the same checks as its download: the manifest alone is fetched, and refused as a load
    would refuse it (a pickle file, other layers, an index, a layer declared over its cap);
    no layer is fetched."""
    source = admit_storage_source(uri, download.policy, download.shown, parse_oci_uri, "oci://REGISTRY/REPOSITORY")
    with probing(download) as fetcher:
        auth = RegistryAuth(fetcher, credential, source.registry, source.repository, download.shown)
        digest, (layers, image) = _manifest(auth, registry_base(download.policy, source), source, "")
    for layer in layers:
        _cap(layer, _layer_cap(layer, image, download.policy), download.shown)
    log.debug("resolved %s to %s", download.shown, digest)
    return digest


def registry_base(policy: SourcePolicy, source: OciSource) -> str:
    """The URL of the repository's API: https, or http for a registry the owner named plain."""
    scheme = "http" if source.registry in policy.oci_plain_http else "https"
    return f"{scheme}://{source.registry}/v2/{source.repository}"


def _manifest(auth: RegistryAuth, base: str, source: OciSource, pinned: str) -> tuple[str, tuple[list[Layer], bool]]:
    """The manifest's digest (the sha256 of the bytes fetched, held to the URI's digest and to
    `pinned`) and its layers (`_layers`); a challenge to the first request is answered once."""
    fetcher, shown = auth.fetcher, auth.shown
    path, url = fetcher.directory / _MANIFEST_FILE, f"{base}/manifests/{source.reference}"
    accept = {"Accept": ", ".join(MANIFEST_TYPES)}
    try:
        written = fetcher.fetch(url, path, MAX_MANIFEST_BYTES, accept)
    except SourceRefused as refusal:
        if refusal.reason != "http_error" or not auth.answer_challenge():
            raise
        written = fetcher.fetch(url, path, MAX_MANIFEST_BYTES, {**accept, **auth.headers})
    digest = f"sha256:{written.sha256}"
    if source.digest and digest != source.digest:
        path.unlink()
        raise SourceRefused(f"the manifest of {shown} does not match its digest: its sha256 is {digest}", "digest_mismatch")
    if pinned and digest != pinned:
        path.unlink()
        raise SourceRefused(
            f"the tag of {shown} moved after it was resolved: it names {digest} now, not {pinned} (the digest its adapter's "
            "status records and every agent loads); refused: name the new content by its digest (@sha256:...) or a new tag",
            "tag_moved",
        )
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError):
        manifest = None
    finally:
        path.unlink()
    return digest, _layers(manifest, shown)


def _layers(manifest: object, shown: str) -> tuple[list[Layer], bool]:
    """The adapter's two layers by title (False), or an image's tar layers (True);
    SourceRefused for anything else (never quoting it)."""
    if not isinstance(manifest, dict) or manifest.get("mediaType", OCI_MANIFEST) not in MANIFEST_TYPES:
        raise SourceRefused(f"{shown} is not an OCI image manifest (an index or another kind is refused)", "bad_manifest")
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise SourceRefused(f"the manifest of {shown} has no valid list of layers", "bad_manifest")
    if layers and all(layer.get("mediaType") in IMAGE_LAYER_TYPES for layer in layers):
        return [_layer(layer, f".layer-{index}", shown) for index, layer in enumerate(layers)], True
    titles = [_title(layer) for layer in layers]
    if any(title.lower().endswith(PICKLE_SUFFIXES) for title in titles):
        raise SourceRefused(f"the artifact {shown} holds a pickle file: only safetensors weights are ever read", "pickle")
    if sorted(titles) != sorted(ADAPTER_FILES):
        raise SourceRefused(
            f"the artifact {shown} must have exactly two layers, titled {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
            f"({TITLE_ANNOTATION}, as oras push writes them); it has {len(layers)} layer(s) and not those two",
            "bad_manifest",
        )
    return [_layer(layer, title, shown) for layer, title in zip(layers, titles, strict=True)], False


def _title(layer: dict[str, object]) -> str:
    annotations = layer.get("annotations")
    title = annotations.get(TITLE_ANNOTATION) if isinstance(annotations, dict) else None
    return title if isinstance(title, str) else ""


def _layer(layer: dict[str, object], title: str, shown: str) -> Layer:
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71 or not isinstance(size, int) or size < 0:
        raise SourceRefused(f"the layer {title} of {shown} has no valid sha256 digest and size", "bad_manifest")
    return Layer(title, digest, size)


def _layer_cap(layer: Layer, image: bool, policy: SourcePolicy) -> int:
    """The most a layer may declare: an image's tar layer may hold both files, an artifact's
    layer is the one file its title names."""
    if image:
        return policy.max_download_bytes + MAX_CONFIG_BYTES
    return MAX_CONFIG_BYTES if layer.filename == ADAPTER_CONFIG else policy.max_download_bytes


def _cap(layer: Layer, cap: int, shown: str) -> int:
    """The layer's declared size, refused before any byte when it is over `cap`."""
    if layer.size > cap:
        raise SourceRefused(f"the layer {layer.filename} of {shown} is {layer.size} bytes, over the {cap}-byte cap", "too_large")
    return layer.size


def _blob(auth: RegistryAuth, base: str, layer: Layer, size: int) -> Written:
    """One layer's blob, by digest, held to the digest and size its descriptor declares."""
    dest: Path = auth.fetcher.directory / layer.filename
    written = auth.fetcher.fetch(f"{base}/blobs/{layer.digest}", dest, size, auth.headers)
    if f"sha256:{written.sha256}" != layer.digest or written.identity.size != size:
        raise SourceRefused(
            f"the layer {layer.filename} of {auth.shown} does not match its descriptor: its sha256 is {written.sha256}",
            "digest_mismatch",
        )
    return written
