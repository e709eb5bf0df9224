"""The prompt cache's disk tier (`--prompt-cache-dir`).

Records are checked (a truncated, corrupted or foreign file is refused) and
written atomically; the directory stays under its cap, least recently used
first, with several writers; an engine restarted on a directory reads back
the prefix an earlier one computed (greedy text unchanged), in the paged
layout (full attention and hybrid) and the padded one; damaged and foreign
files are skipped and the prefix computed; files hold the quantized bytes;
a writer that is stuck never holds the engine up; a flood under a KV budget
too small for it preempts and resumes through the prompt cache and the
disk, within the budget.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.events import Collector
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load

from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    Checkpoint,
    Engine,
    EngineOptions,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    Segment,
)
from mlx_kvq.engine.budget import Shape, share_for
from mlx_kvq.engine.disk import DiskSettings
from mlx_kvq.engine.disk.directory import DiskDirectory, chain_digests
from mlx_kvq.engine.disk.fingerprint import Fingerprint
from mlx_kvq.engine.disk.records import (
    RecordError,
    Skip,
    encode,
    is_temporary,
    read_header,
    read_record,
    temporary_name,
    write_record,
)
from mlx_kvq.engine.disk.writer import DiskWriter, WriteJob
from mlx_kvq.engine.memory import DECODE_RESERVE
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.plan import plan_kv

FP = Fingerprint("ab" * 16, {"test": True})
OTHER = Fingerprint("cd" * 16, {"test": False})
CHUNK = 64  # tokens per chunk file in these tests (16 blocks of 4)


def _tensors(seed: int = 0) -> list[tuple[str, mx.array]]:
    mx.random.seed(seed)
    out = [
        ("a", mx.random.normal((5, 2, 3))),
        ("b", mx.random.normal((7,)).astype(mx.float16)),
        ("c", mx.random.normal((3, 4)).astype(mx.bfloat16)),
        ("d", mx.arange(12, dtype=mx.uint32).reshape(3, 4)),
        ("e", mx.zeros((0, 4))),
    ]
    mx.eval([a for _, a in out])
    return out


def _write(path: Path, fp: Fingerprint = FP, seed: int = 0, **header) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_record(path, encode({"fingerprint": fp.digest, **header}, _tensors(seed)))


# -- records ---------------------------------------------------------------------------
def test_a_record_round_trips_every_dtype(tmp_path):
    path = tmp_path / "r.kvc"
    size = _write(path, kind="chunk")
    assert size == path.stat().st_size
    record = read_record(path, FP.digest)
    assert record.header["kind"] == "chunk"
    for name, a in _tensors():
        got = record.tensor(name)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert np.array_equal(np.array(got.astype(mx.float32)), np.array(a.astype(mx.float32)))
    assert not [p for p in tmp_path.iterdir() if is_temporary(p.name)]


def test_truncated_and_corrupted_records_are_refused(tmp_path):
    path = tmp_path / "r.kvc"
    size = _write(path)
    data = path.read_bytes()
    for cut in (0, 5, 16, 40, size // 2, size - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(RecordError) as e:
            read_record(path, FP.digest)
        assert e.value.reason is Skip.CORRUPT, cut
    for at in (3, 20, size - 5):  # the magic, the header, a tensor's bytes
        bad = bytearray(data)
        bad[at] ^= 0x10
        path.write_bytes(bytes(bad))
        with pytest.raises(RecordError) as e:
            read_record(path, FP.digest)
        assert e.value.reason is Skip.CORRUPT, at
    path.write_bytes(data)
    read_record(path, FP.digest)  # the same bytes check out again


def test_another_fingerprint_or_format_is_foreign(tmp_path, monkeypatch):
    path = tmp_path / "r.kve"
    _write(path, fp=OTHER)
    with pytest.raises(RecordError) as e:
        read_record(path, FP.digest)
    assert e.value.reason is Skip.FOREIGN
    from mlx_kvq.engine.disk import records

    _write(path)
    monkeypatch.setattr(records, "FORMAT", records.FORMAT + 1)
    with pytest.raises(RecordError) as e:
        read_record(path, FP.digest)
    assert e.value.reason is Skip.FOREIGN


def test_a_writer_stopped_before_its_rename_leaves_only_a_temporary_file(tmp_path):
    path = tmp_path / FP.digest[:16] / "c" / "ab" / "x.kvc"
    path.parent.mkdir(parents=True)

    def stop() -> None:
        raise KeyboardInterrupt  # the process ends halfway through the data

    with pytest.raises(KeyboardInterrupt):
        write_record(path, encode({"fingerprint": FP.digest}, _tensors()), stop)
    assert not path.exists()
    # a SIGKILL leaves the temporary file behind: the next start removes it
    temporary_name(path).write_bytes(b"partial")
    census = DiskDirectory(tmp_path, FP, 1 << 20, CHUNK).open()
    assert census.removed_temporary == 1 and census.files == 0
    assert not any(is_temporary(p.name) for p in tmp_path.rglob("*"))


# -- the directory -----------------------------------------------------------------------
def _job(d: DiskDirectory, name: str, seed: int = 0) -> WriteJob:
    path = d.chunk_path(name)
    header = {"kind": "chunk", "fingerprint": d.fp.digest}
    tensors = tuple(_tensors(seed))
    return WriteJob(path, header, tensors, sum(a.nbytes for _, a in tensors))


def _record_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kv[ce]"))


def test_the_cap_evicts_the_least_recently_used_first(tmp_path):
    one = _write(tmp_path / "probe.kvc")
    (tmp_path / "probe.kvc").unlink()
    d = DiskDirectory(tmp_path, FP, 3 * one + one // 2, CHUNK)
    d.open()
    w = DiskWriter(d)
    names = [f"{i:02x}" * 16 for i in range(3)]
    for name in names:
        assert w.offer(_job(d, name))
    w.flush(30)
    w.touch([d.chunk_path(names[0])])  # used again: now the most recent
    assert w.offer(_job(d, "ff" * 16))
    w.flush(30)
    assert d.has_chunk(names[0]) and not d.has_chunk(names[1]) and d.has_chunk(names[2])
    assert _record_bytes(tmp_path) <= d.max_bytes and d.evictions == 1
    w.close(5)


def test_startup_counts_every_model_and_evicts_to_the_cap(tmp_path):
    for i in range(4):  # another model's files, older
        _write(tmp_path / OTHER.digest[:16] / "c" / "00" / f"{i:032x}.kvc", fp=OTHER)
    one = (tmp_path / OTHER.digest[:16] / "c" / "00" / f"{0:032x}.kvc").stat().st_size
    d = DiskDirectory(tmp_path, FP, 2 * one, CHUNK)
    census = d.open()  # over the cap: the oldest go
    assert census.foreign_files == 2 and census.foreign_bytes == 2 * one
    assert _record_bytes(tmp_path) <= 2 * one
    w = DiskWriter(d)
    w.offer(_job(d, "11" * 16))
    w.flush(30)
    assert d.has_chunk("11" * 16) and _record_bytes(tmp_path) <= 2 * one
    w.close(5)


def test_two_servers_sharing_a_directory_stay_under_the_cap(tmp_path):
    one = _write(tmp_path / "probe.kvc")
    (tmp_path / "probe.kvc").unlink()
    cap = 5 * one
    a = DiskDirectory(tmp_path, FP, cap, CHUNK)
    b = DiskDirectory(tmp_path, OTHER, cap, CHUNK)
    a.open()
    b.open()
    wa, wb = DiskWriter(a), DiskWriter(b)
    for i in range(8):
        wa.offer(_job(a, f"{i:032x}", i))
        wb.offer(_job(b, f"{i + 100:032x}", i))
        wa.flush(30)
        wb.flush(30)
        assert _record_bytes(tmp_path) <= cap, i
    assert sum(a.has_chunk(f"{i:032x}") for i in range(8)) >= 1
    wa.close(5)
    wb.close(5)


# -- engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in ("llama", "llama:sliding"):
        path = save_tiny_model(tmp_path_factory.mktemp("disk") / kind.replace(":", "_"), kind)
        model, tokenizer = load(str(path))
        out[kind] = (model, tokenizer)
    return out


def _engine(
    models, kind, directory, block=4, bits=4, cache_entries=10, budget=None, step=2048, **disk
) -> Engine:
    model, tokenizer = models[kind]
    kv = KVConfig(bits=bits, group_size=64)
    plan = plan_kv(model, kv, batch=True)
    settings = None
    if directory is not None:
        settings = DiskSettings(str(directory), chunk_tokens=CHUNK, **disk)
    options = EngineOptions(
        block_size=block, max_context=plan.max_context, disk=settings,
        prompt_cache_size=cache_entries, kv_cache_memory=budget, prefill_step_size=step,
    )  # fmt: skip
    eng = Engine(model, tokenizer, plan, kv, options)
    eng.start()
    assert eng.readiness.ready_event.wait(120) and eng.readiness.ready, eng.readiness.get()
    return eng


def _ask(eng: Engine, prompt: list[int], max_tokens: int = 6, checkpoints=()) -> Collector:
    c = Collector()
    params = SamplingParams(max_tokens=max_tokens)
    eng.submit(GenerationRequest(list(prompt), params, checkpoints=checkpoints), c)
    return c.wait()


def _stop(eng: Engine) -> None:
    if eng.disk is not None:
        assert eng.disk.flush(60)
    eng.stop()


PROMPT = [(7 * i) % 300 + 3 for i in range(300)]  # 4 chunks and a tail


@pytest.mark.parametrize(
    "kind,block", [("llama", 4), ("llama:sliding", 4), ("llama:sliding", None)],
    ids=["paged-full", "paged-hybrid", "padded"],
)  # fmt: skip
def test_a_restarted_engine_reads_its_prefix_from_disk(models, tmp_path, kind, block):
    first = _engine(models, kind, tmp_path, block)
    cold = _ask(first, PROMPT)  # an empty directory: the whole prefill
    assert cold.end.usage.cached_tokens == 0
    _stop(first)
    second = _engine(models, kind, tmp_path, block)
    again = _ask(second, PROMPT)
    stats = second.disk.stats()
    _stop(second)
    assert again.tokens == cold.tokens
    assert again.end.usage.cached_tokens == len(PROMPT) - 1
    assert (stats.hits, stats.misses, stats.tokens_read) == (1, 0, len(PROMPT) - 1)
    assert stats.writes == 0  # nothing new: the entry and its chunks are on disk


def test_a_shared_prefix_is_written_once_and_a_diverging_prompt_maps_its_chunks(models, tmp_path):
    shared = PROMPT[: 3 * CHUNK + 5]
    one, two = shared + [11] * 40, shared + [12] * 40
    reference = _engine(models, "llama", None)
    want = _ask(reference, two).tokens
    _stop(reference)
    first = _engine(models, "llama", tmp_path)
    _ask(first, one)
    assert first.disk.flush()  # the writer runs beside the engine: count once it is done
    stats = first.disk.stats()
    digests = chain_digests(first.disk.directory.fp.root, one + _ask(first, one).tokens, CHUNK)
    _stop(first)
    chunk_files = sorted(p.stem for p in tmp_path.rglob("*.kvc"))
    assert chunk_files == sorted(set(digests)) and stats.writes == stats.files
    second = _engine(models, "llama", tmp_path)
    got = _ask(second, two)  # no entry is a prefix of it; its first 3 chunks are on disk
    _stop(second)
    assert got.tokens == want and got.end.usage.cached_tokens == 3 * CHUNK


def test_damaged_files_are_skipped_and_the_prefix_computed(models, tmp_path, caplog):
    first = _engine(models, "llama", tmp_path)
    cold = _ask(first, PROMPT)
    fp = first.disk.directory.fp
    _stop(first)
    d = DiskDirectory(tmp_path, fp, 1 << 30, CHUNK)
    entry = next(
        p for p in tmp_path.rglob("*.kve") if read_header(p, fp.digest)[0]["length"] < len(PROMPT)
    )
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # truncated
    chunk = d.chunk_path(chain_digests(fp.root, PROMPT, CHUNK)[1])
    data = bytearray(chunk.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern in a tensor
    chunk.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, "mlx_kvq.engine")
    second = _engine(models, "llama", tmp_path)
    got = _ask(second, PROMPT)
    stats = second.disk.stats()
    _stop(second)
    assert got.tokens == cold.tokens
    assert got.end.usage.cached_tokens == CHUNK  # the one chunk before the damaged one
    assert dict(stats.skips)["corrupt"] == 2  # the entry when counted, the chunk when read
    said = [r.getMessage() for r in caplog.records]
    assert any(entry.name in m and "not used, removed" in m for m in said)
    assert any("not used (corrupt)" in m and "checksum" in m for m in said)
    for path in (entry, chunk):  # removed, then written again from the computed prefix
        read_record(path, fp.digest)


def test_files_of_another_kv_setting_are_never_loaded(models, tmp_path, caplog):
    first = _engine(models, "llama:sliding", tmp_path, bits=4)
    _ask(first, PROMPT)
    fp4 = first.disk.directory.fp
    _stop(first)
    caplog.set_level(logging.INFO, "mlx_kvq.engine")
    second = _engine(models, "llama:sliding", tmp_path, bits=8)
    assert second.disk.directory.fp.digest != fp4.digest
    # a 4-bit entry copied under the 8-bit fingerprint's directory: refused at startup
    _stop(second)
    stray = next(tmp_path.rglob("*.kve"))
    home = second.disk.directory.home / "e" / stray.stem[:2]
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(stray, home / stray.name)
    third = _engine(models, "llama:sliding", tmp_path, bits=8)
    got = _ask(third, PROMPT)
    stats = third.disk.stats()
    _stop(third)
    assert got.end.usage.cached_tokens == 0 and stats.hits == 0 and stats.misses == 1
    assert not (home / stray.name).exists()
    assert stats.foreign_bytes > 0  # the 4-bit files count against the cap
    said = [r.getMessage() for r in caplog.records]
    assert any("not used, removed" in m and "another model or KV setting" in m for m in said)
    assert any("of other models, settings or versions, never loaded" in m for m in said)


def test_files_hold_the_quantized_bytes(models, tmp_path):
    eng = _engine(models, "llama", tmp_path, bits=4)
    _ask(eng, PROMPT)
    fp = eng.disk.directory.fp
    full = [p for p in eng.plan.kv_layers if p.window is None]
    _stop(eng)
    quantized = sum(p.bytes_per_token() for p in full)
    float16 = sum(p.kv_heads * (p.key_dim + p.value_dim) * 2 for p in full)
    for path in tmp_path.rglob("*.kvc"):
        header, start, size = read_header(path, fp.digest)
        assert header["data_bytes"] == CHUNK * quantized
        assert header["data_bytes"] / (CHUNK * float16) == pytest.approx(0.28125)
        assert size - header["data_bytes"] < 0.1 * size  # the header and its table


def test_a_stuck_writer_never_holds_the_engine_up(models, tmp_path):
    gate = tmp_path / "gate"
    cap = 120_000
    eng = _engine(models, "llama", tmp_path / "dir", max_bytes=cap, write_gate=str(gate))
    prompts = [[n + 1] + PROMPT[:250] for n in range(4)]
    answers = [_ask(eng, p) for p in prompts]  # the writer waits inside its first file
    stuck = eng.disk.stats()
    gate.touch()
    assert eng.disk.flush(60)
    done = eng.disk.stats()
    _stop(eng)
    assert all(a.end.usage.completion_tokens == 6 for a in answers)
    assert Path(str(gate) + ".waiting").exists() and stuck.writes == 0
    assert stuck.queued_bytes <= cap and dict(stuck.skips).get("queue_full", 0) > 0
    assert done.writes > 0 and _record_bytes(tmp_path / "dir") <= cap


def test_a_restore_maps_the_blocks_memory_still_holds(models, tmp_path, caplog):
    eng = _engine(models, "llama:sliding", tmp_path, cache_entries=2)
    system = (Checkpoint(150, Segment.SYSTEM),)
    cold = _ask(eng, PROMPT, checkpoints=system)
    _ask(eng, PROMPT[:150] + [5] * 100, checkpoints=system)  # memory: the system prompt and it
    assert eng.disk.flush(60)  # the writer is behind the engine, by design
    caplog.set_level(logging.INFO, "mlx_kvq.engine")
    again = _ask(eng, PROMPT, checkpoints=system)  # the rest of the first prompt is on disk
    _stop(eng)
    assert again.tokens == cold.tokens and again.end.usage.cached_tokens == len(PROMPT) - 1
    line = next(r.getMessage() for r in caplog.records if "prompt cache dir (" in r.getMessage())
    # the system prompt's whole blocks in the full-attention layers are not read again
    assert "(148 of them mapped from memory" in line


@pytest.mark.parametrize("block", [4, None], ids=["paged-hybrid", "padded"])
def test_a_flood_under_a_small_budget_preempts_and_resumes_with_the_disk_tier(
    models, tmp_path, block
):
    """Eight requests sharing a system prompt on a hybrid model, under a budget
    that holds three as they start (their prefix not shared) and fewer whole: the newest are preempted
    as the older ones grow and resume (the prompt cache and the disk keep the
    prefix), every one is served, and the budget holds (the suite fails a
    test whose engine counted an overrun)."""
    model, _ = models["llama:sliding"]
    plan = plan_kv(model, KVConfig(bits=4, group_size=64), batch=True)
    layout = choose_layout(plan, block, on_disk=True)
    cost = share_for(plan, 1, prefill_step=16, prompt_rows=8, paged=layout.paged,
                     block_size=layout.block_size or 0).cost  # fmt: skip
    system = (Checkpoint(150, Segment.SYSTEM),)
    prompts = [PROMPT[:150] + [(13 * i + j) % 300 + 3 for j in range(30)] for i in range(8)]
    p, answer = len(prompts[0]), 80
    start = [Shape(p, p + DECODE_RESERVE)] * 3
    budget = cost.bound(start, start)
    whole = max(n for n in range(1, 8) if cost.bound([Shape(p, p + answer)] * n, []) <= budget)
    assert whole < 3
    eng = _engine(models, "llama:sliding", tmp_path, block, budget=budget, step=16)
    sinks = []
    for prompt in prompts:
        c = Collector()
        params = SamplingParams(max_tokens=answer, temperature=0.0)
        eng.submit(GenerationRequest(prompt, params, checkpoints=system), c)
        sinks.append(c)
    for c in sinks:
        c.wait()
    m, ledger, stats = eng.metrics.snapshot(), eng.budget, eng.disk.stats()
    _stop(eng)
    assert all(isinstance(c.end, FinishEvent) for c in sinks), [c.end for c in sinks]
    assert all(c.end.usage.completion_tokens == len(c.tokens) > 0 for c in sinks)
    assert m.preemptions > 0 and 0 < m.resumptions <= m.preemptions
    assert 0 < ledger.peak_held <= budget and ledger.overruns == 0
    assert stats.writes > 0
