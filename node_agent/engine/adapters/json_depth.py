"""How deep a JSON text nests, measured before it is parsed (`json.loads` recurses): the bound
both the adapter config and the safetensors header are read under."""

MAX_JSON_DEPTH = 64  # PEFT's configs nest 3 deep; json.loads recurses, so deeper is refused before parsing

# Every byte but the four brackets (UTF-8 never puts a bracket byte inside another character).
_NOT_BRACKET_BYTES = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in a JSON text, by linear scans (strings skipped); the
    count stops, returning MAX_JSON_DEPTH + 1, once that depth is reached.

    Escaped backslashes, then escaped quotes, are dropped (escapes pair from the left, as JSON
    reads them), so every quote left delimits a string and the text outside strings is every
    other piece between quotes. Only C-level string operations touch the whole text (a regex
    substitution per string cost most of a load's validation on a safetensors header).
    """
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    brackets = outside.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKET_BYTES)
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                return deepest  # enough to refuse: the rest is not scanned
    return deepest
