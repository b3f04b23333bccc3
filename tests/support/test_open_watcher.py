"""Self-check of tests/support/open_watcher.py: it sees opens by anyone and stays silent otherwise
(so it can fail)."""

from __future__ import annotations

import os

from tests.support.bad_adapters import make_adapter_with_pickle_decoys
from tests.support.open_watcher import FileOpenWatcher


def test_open_watcher_sees_opens_only(llama, work):
    d, decoys, _ = make_adapter_with_pickle_decoys(llama, work / "watched", target_modules=["q_proj"])
    with FileOpenWatcher(decoys) as w:
        os.stat(decoys[0])
        os.listdir(d)
    assert not w.opened
    with FileOpenWatcher(decoys) as w, open(decoys[1], "rb") as fh:
        fh.read(1)
    assert w.opened == {decoys[1]}
