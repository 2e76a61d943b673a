"""The data directory stops taking usage records: a full disk (a real 1 MiB tmpfs, filled),
a read-only file system and a spill file that cannot grow (both injected: the file system
refuses the spill file's appends with ``EROFS`` / ``EFBIG``). A gateway in front of the
stand-in engine, budgets in Redis, records in PostgreSQL.

- PostgreSQL up: every request is answered and recorded (each record committed at once, as
  the spill file refuses it), and ``/ready`` says 503 so a load balancer moves traffic away.
- PostgreSQL down too: no answer without its record: OpenAI's 503
  ``usage_records_unavailable`` with ``Retry-After`` and the request id, the reservation
  released, never a 200 billed to nobody.
- Both back: ``/ready`` turns 200 by itself, requests are served, and the ledger's ``used``
  is exactly what the records charge, nothing left reserved.
"""

from __future__ import annotations

import errno
import hashlib
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import SPILL_FILENAME
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.spill_file import SpillFile
from gateway.storage.usage_store import sum_tokens
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL

pytestmark = pytest.mark.timeout(180)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**CHAT, "stream": True}
QUOTA = {"rpm": 1_000_000, "budget_tokens": 10**9, "budget_period": "day"}
EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path, spill: Path) -> Path:
    """Fill ``disk`` to the last byte once the spill file is empty (its pages freed: records
    could otherwise go on landing in its last page); returns the file to delete to free it."""
    wait_until(lambda: spill.stat().st_size == 0, 10, "the spill file to be emptied")
    filler = disk / "filler"
    with open(filler, "ab", buffering=0) as out:
        for block in (65536, 1):
            with pytest.raises(OSError, match="No space left"):
                _write_forever(out, b"\0" * block)
    return filler


def _write_forever(out: Any, data: bytes) -> None:
    while True:
        out.write(data)


class DataDirectory:
    """The gateway's data directory, and a way to make it refuse the spill file's appends
    (``refuse``) and take them again (``heal``)."""

    def __init__(self, kind: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kind = kind
        self.root = root
        self._monkeypatch = monkeypatch
        self._filler: Path | None = None

    def refuse(self) -> None:
        if self.kind == "full":
            self._filler = fill(self.root, self.root / "gateway" / SPILL_FILENAME)
            return
        code = errno.EROFS if self.kind == "read_only" else errno.EFBIG

        def refused(spill: SpillFile, data: bytes) -> None:
            raise OSError(code, "injected")

        self._monkeypatch.setattr(SpillFile, "append", refused)
        self._monkeypatch.setattr(SpillFile, "probe", lambda spill: refused(spill, b""))

    def heal(self) -> None:
        if self._filler is not None:
            self._filler.unlink()
        self._monkeypatch.undo()


@pytest.fixture(params=["full", "read_only", "cannot_grow"])
def data_dir(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DataDirectory]:
    if request.param == "full":
        with tmpfs(tmp_path / "disk", "1m") as disk:
            yield DataDirectory("full", disk, monkeypatch)
    else:
        yield DataDirectory(request.param, tmp_path / "data", monkeypatch)


def charged(database_url: str, tenant_id: str) -> int:
    database = Database(database_url)
    try:
        with database.session() as session:
            totals = sum_tokens(
                session, tenant_id, EPOCH, datetime.now(timezone.utc) + timedelta(days=1)
            )
        return totals.prompt_tokens + totals.completion_tokens
    finally:
        database.dispose()


def stream_ending(answer: httpx.Response) -> tuple[dict[str, Any] | None, str]:
    """A streamed answer's last event before ``[DONE]`` (parsed), and its last line."""
    events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    last_before = events[-2].removeprefix("data: ") if len(events) >= 2 else None
    parsed = httpx.Response(200, content=last_before).json() if last_before else None
    return parsed, events[-1] if events else ""


def test_no_answer_goes_out_without_its_record(
    data_dir: DataDirectory,
    postgres_process: Any,
    redis_process: Any,
    gateway_settings: Callable[..., GatewaySettings],
    serve_gateway: Callable[[GatewaySettings], str],
    make_tenant: Callable[..., tuple[str, str]],
) -> None:
    settings = gateway_settings(
        data_dir=str(data_dir.root / "gateway"),
        database_url=postgres_process.url,
        redis_url=redis_process.url,
        admin_key_hash=hashlib.sha256(b"unused").hexdigest(),
    )
    base_url = serve_gateway(settings)
    tenant_id, key = make_tenant(postgres_process.url, **QUOTA)
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, timeout=30, headers=headers) as client:

        def budget() -> dict[str, int]:
            answer = client.get("/v1/budget")
            assert answer.status_code == 200, answer.text
            return dict(answer.json())

        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.get("/ready").status_code == 200

        # The spill file refuses; PostgreSQL takes each record at once.
        data_dir.refuse()
        answers = [client.post("/v1/chat/completions", json=body) for body in [CHAT, STREAM] * 3]
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert all(stream_ending(a)[1] == "data: [DONE]" for a in answers[1::2])
        ready = client.get("/ready")
        assert (ready.status_code, ready.json()) == (503, {"status": "usage_records_unwritable"})
        assert charged(postgres_process.url, tenant_id) == budget()["used"]

        # PostgreSQL down too: nothing is answered, nothing is charged.
        used_before = budget()["used"]
        postgres_process.stop()
        try:
            for body in [CHAT, STREAM] * 3:
                answer = client.post("/v1/chat/completions", json=body)
                if answer.status_code == 200:  # a stream that started: its error event ends it
                    error, last = stream_ending(answer)
                    assert last == "data: [DONE]", answer.text
                    assert error is not None, answer.text
                    assert error["error"]["code"] == "usage_records_unavailable"
                    continue
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "usage_records_unavailable"
                assert answer.json()["error"]["type"] == "server_error"
                assert answer.headers["retry-after"]
                assert answer.headers["x-request-id"]
        finally:
            data_dir.heal()
            postgres_process.start()
        held = budget()  # (/v1/budget reads the database): nothing charged, nothing held
        assert (held["used"], held["reserved"]) == (used_before, 0)

        # Both back: ready by itself, served, and the ledger is the records.
        wait_until(lambda: client.get("/ready").status_code == 200, 10, "/ready to say 200")
        for body in (CHAT, STREAM):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        wait_until(
            lambda: charged(postgres_process.url, tenant_id) == budget()["used"],
            20,
            "the records to match the ledger",
        )
        assert budget()["reserved"] == 0
