"""Write ``gateway/admission/encodings/*.tiktoken`` from the rank tables in the npm package
js-tiktoken.

Run once, by hand, when the encodings are (re)vendored; the gateway never runs it::

    cd /tmp && npm pack js-tiktoken            # -> js-tiktoken-<version>.tgz
    python deploy/make_tiktoken_files.py /tmp/js-tiktoken-<version>.tgz

js-tiktoken (MIT) stores each encoding as ``dist/ranks/<name>.cjs``: a JSON object whose
``bpe_ranks`` string holds lines ``<label> <first rank> <base64 token> <base64 token> ...``,
consecutive tokens taking consecutive ranks. This script expands them into the standard
``.tiktoken`` format (``<base64 token> <rank>`` per line, in rank order) and refuses to write a
file whose sha256 differs from the hash tiktoken's own ``tiktoken_ext/openai_public.py`` expects
for it, so the output is byte for byte the file tiktoken would have downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tarfile
from pathlib import Path
from typing import Any
from unittest import mock

from tiktoken_ext import openai_public

ENCODINGS = ("cl100k_base", "o200k_base")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "gateway" / "encodings"
_JS_PREFIXES = ("module.exports = ", "export default ")


def expected_hash(name: str) -> str:
    """The sha256 tiktoken checks its download of ``name`` against (read, not downloaded)."""
    seen: list[str] = []

    def capture(blobpath: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if expected_hash is None:
            raise ValueError(f"tiktoken gives no expected hash for {blobpath}")
        seen.append(expected_hash)
        return {}

    with mock.patch.object(openai_public, "load_tiktoken_bpe", capture):
        openai_public.ENCODING_CONSTRUCTORS[name]()
    if len(seen) != 1:
        raise ValueError(f"expected one rank file for {name}, tiktoken asked for {len(seen)}")
    return seen[0]


def read_js_ranks(tarball: tarfile.TarFile, name: str) -> dict[str, Any]:
    member = tarball.extractfile(f"package/dist/ranks/{name}.cjs")
    if member is None:
        raise ValueError(f"package/dist/ranks/{name}.cjs is missing from the tarball")
    source = member.read().decode("utf-8").strip().rstrip(";")
    for prefix in _JS_PREFIXES:
        if source.startswith(prefix):
            data = json.loads(source[len(prefix) :])
            if not isinstance(data, dict):
                raise ValueError(f"{name}.cjs does not export an object")
            return data
    raise ValueError(f"{name}.cjs does not start with one of {_JS_PREFIXES}")


def expand_ranks(bpe_ranks: str) -> list[tuple[str, int]]:
    """``<label> <first rank> tok tok ...`` lines -> ``(base64 token, rank)`` in rank order."""
    pairs: list[tuple[str, int]] = []
    for line in bpe_ranks.split("\n"):
        if not line:
            continue
        _label, first, *tokens = line.split(" ")
        offset = int(first)
        pairs.extend((token, offset + i) for i, token in enumerate(tokens))
    pairs.sort(key=lambda pair: pair[1])
    ranks = [rank for _, rank in pairs]
    if ranks != list(range(len(ranks))):
        raise ValueError("ranks are not the consecutive integers 0..n-1")
    return pairs


def to_tiktoken_file(pairs: list[tuple[str, int]]) -> bytes:
    return "".join(f"{token} {rank}\n" for token, rank in pairs).encode("ascii")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("tarball", type=Path, help="js-tiktoken-<version>.tgz from `npm pack`")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tarfile.open(args.tarball) as tarball:
        package_file = tarball.extractfile("package/package.json")
        if package_file is None:
            raise ValueError("package/package.json is missing from the tarball")
        package = json.loads(package_file.read())
        print(f"{package['name']} {package['version']} ({package['license']})")
        for name in ENCODINGS:
            data = to_tiktoken_file(expand_ranks(read_js_ranks(tarball, name)["bpe_ranks"]))
            digest = hashlib.sha256(data).hexdigest()
            want = expected_hash(name)
            if digest != want:
                raise SystemExit(f"{name}: sha256 {digest} != tiktoken's expected {want}")
            path = args.out / f"{name}.tiktoken"
            path.write_bytes(data)
            print(f"{path}: {len(data)} bytes, sha256 {digest} (matches tiktoken)")


if __name__ == "__main__":
    main()
