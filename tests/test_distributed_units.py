"""Pieces of the distributed layer that need no second process."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing

import mlx.core as mx
import pytest
from kvq_testing import archs
from kvq_testing.distributed import tiny_model

from mlx_kvq.caches import KVQFullCache
from mlx_kvq.config import KVConfig, QuantSpec, UnsupportedKVConfig
from mlx_kvq.distributed import wire
from mlx_kvq.distributed.coordinator import (
    LOCAL_ONLY,
    GroupCoordinator,
    commands_from_payload,
    commands_payload,
)
from mlx_kvq.distributed.group import env_leader_host, exchange, gather_json
from mlx_kvq.distributed.heartbeat import RankLoss
from mlx_kvq.distributed.loading import (
    PIPELINE,
    SPLIT,
    TENSOR,
    Shard,
    kv_replicas,
    replicate_kv_heads,
)
from mlx_kvq.distributed.planning import (
    check_sharding,
    group_plan_dict,
    local_config,
    ranks_table,
)
from mlx_kvq.engine import (
    GenerationRequest,
    SamplingParams,
    StepCommands,
    StopNotice,
    WarmupVerdict,
)
from mlx_kvq.model_facts import declared, facts
from mlx_kvq.quant import Store


def test_skip_layers_name_model_layers_and_each_pipeline_rank_maps_its_own():
    kv = KVConfig(bits=4, allow_partial=True, skip_layers=(1, 3))
    last = Shard(PIPELINE, rank=0, size=2, first_layer=2, num_layers=2, total_layers=4)
    first = Shard(PIPELINE, rank=1, size=2, first_layer=0, num_layers=2, total_layers=4)
    assert local_config(kv, last).skip_layers == (1,)  # model layer 3 = its slot 1
    assert local_config(kv, first).skip_layers == (1,)  # model layer 1 = its slot 1
    every = Shard(TENSOR, rank=1, size=2, first_layer=0, num_layers=4, total_layers=4)
    assert local_config(kv, every) is kv


class FakeHeartbeat:
    """What the coordinator uses of a heartbeat, recorded."""

    def __init__(self):
        self.on_lost = None
        self.progress = self.step_timeout = None
        self.fatal: list[str] = []
        self.closing = False

    def set_on_lost(self, callback):
        self.on_lost = callback

    def report_fatal(self, reason):
        self.fatal.append(reason)

    def stopping(self):
        self.closing = True

    def up(self, rank):
        return True


class FakeEngine:
    alive = True

    def __init__(self):
        self.failed: list[str] = []

    def fail(self, reason):
        self.failed.append(reason)


def coordinator():
    hb = FakeHeartbeat()
    infos = [{"rank": 0, "mode": "tensor", "layers": "0-3", "kv_heads": [2], "bytes_per_token": 96}]
    c = GroupCoordinator(hb, infos, step_timeout=5.0)
    engine = FakeEngine()
    c.bind(engine)
    return c, hb, engine


def test_group_warmup_is_ready_only_when_every_rank_passed():
    c, hb, _ = coordinator()
    assert hb.on_lost == c.on_rank_lost and hb.progress == c.busy_seconds
    batch = {"full": {"slots": 2, "quantized": 2, "max_tokens": 9, "nbytes": 300}}
    verdict = c.agree_warmup(WarmupVerdict(True, report={"batch": batch}))
    assert verdict.ok and verdict.report["ranks"][0]["kv_bytes"] == 300
    assert verdict.report["ranks"][0]["layers"] == "0-3"
    failed = c.agree_warmup(WarmupVerdict(False, error="2 of 2 full caches were not quantized"))
    assert not failed.ok and failed.error == (
        "warm-up failed on rank 0: 2 of 2 full caches were not quantized"
    )


def test_a_lost_rank_fails_the_engine_at_once_with_the_reason():
    c, hb, engine = coordinator()
    c.on_rank_lost(RankLoss(1, "its process exited or was killed"))
    assert engine.failed == [
        "rank 1 of 1 is lost: its process exited or was killed; the group cannot serve "
        "until all ranks are restarted"
    ]
    assert hb.fatal == engine.failed
    # the engine thread's own error afterwards reports the group's reason, not its own
    assert c.stopping(StopNotice("engine failed: RuntimeError: peer lost")) == engine.failed[0]
    c.on_rank_lost(RankLoss(None, "stuck"))  # once failed, later losses change nothing
    assert len(engine.failed) == 1


def test_a_rank_that_reported_its_failure_is_named_with_its_reason():
    c, _, engine = coordinator()
    c.on_rank_lost(RankLoss(1, "rank 1: warm-up failed: boom", reported=True))
    assert engine.failed[0].startswith("rank 1 of 1 failed (rank 1: warm-up failed: boom)")


def test_single_rank_step_passes_the_leaders_commands_through():
    c, hb, _ = coordinator()
    from mlx_kvq.engine import RankStatus

    cmds = StepCommands(cancels=frozenset({3}))
    assert c.step(cmds, RankStatus(kv_bytes=7)) == cmds and c.rank_kv == [7]
    assert c.step(StepCommands(stop=True), RankStatus()).stop
    assert c.stopped_normally and hb.closing


def test_single_process_collectives_are_the_identity():
    assert gather_json({"a": 1}) == [{"a": 1}]
    headers, payload = exchange([0, 5], b"cmd")
    assert headers[0][1] == 5 and payload == b"cmd"


def test_pipeline_send_dependency_on_a_quantized_cache():
    """mlx-lm's pipeline stages end with this line; a quantized cache takes it:
    same stored data, the dependency attached, and the cache keeps working."""
    spec = QuantSpec(4, 64)
    cache = KVQFullCache(spec, spec)
    cache.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    before = [mx.array(p) for p in cache.keys.parts]
    sent = mx.array(1.0)
    cache.keys = mx.depends(cache.keys, sent)  # the line in mlx-lm's models
    assert isinstance(cache.keys, Store) and cache.keys.spec == spec
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, cache.keys.parts, strict=True))
    k, _ = cache.update_and_fetch(mx.ones((1, 2, 1, 64)), mx.ones((1, 2, 1, 64)))
    assert k.shape == (1, 2, 4, 64) and cache.offset == 4
    with pytest.raises(TypeError, match="KVQFullCache.keys"):
        cache.keys = mx.zeros((3,))  # anything else is refused


def test_group_plan_reports_every_rank():
    def plan(kv_layers, bpt, kinds=("full",)):
        layers = [{"slot": i, "kind": kinds[i % len(kinds)]} for i in range(kv_layers)]
        return {"model_type": "m", "layers": layers, "kv_layers": kv_layers,
                "quantized_layers": kv_layers, "kinds": list(kinds), "max_window": None,
                "partial": False, "sinks": False, "notes": [], "bytes_per_token": bpt,
                "fp16_bytes_per_token": 4 * bpt}  # fmt: skip

    infos = [{"rank": 0, "mode": "pipeline", "layers": "2-3", "bytes_per_token": 10, "kv": "K",
              "model_type": "m", "kv_heads": [2], "kv_layers": 2, "quantized_layers": 2},
             {"rank": 1, "mode": "pipeline", "layers": "0-1", "bytes_per_token": 12, "kv": "K",
              "model_type": "m", "kv_heads": [2], "kv_layers": 2, "quantized_layers": 2}]  # fmt: skip
    out = group_plan_dict([plan(2, 10), plan(2, 12)], infos)
    assert out["kv_layers"] == 4 and out["bytes_per_token"] == 22
    assert [layer["rank"] for layer in out["layers"]] == [1, 1, 0, 0]  # model order
    assert "2 ranks (pipeline parallel)" in out["summary"] and "10 + 12" in out["summary"]
    table = ranks_table(infos, [100, 120])
    assert "rank 0: layers 2-3" in table and "120 KV bytes held" in table


# -- tensor parallelism with fewer KV heads than ranks -----------------------------
def test_replicas_make_the_ranks_divide_the_kv_heads():
    assert [kv_replicas(h, 2) for h in (1, 2, 3, 4)] == [2, 1, 2, 1]
    assert [kv_replicas(h, 4) for h in (1, 2, 3, 6, 8)] == [4, 2, 4, 2, 1]
    for h, n in ((1, 2), (3, 2), (2, 4), (6, 4), (1, 8)):
        assert (h * kv_replicas(h, n)) % n == 0


@pytest.mark.parametrize("name", declared("kv_heads"))
def test_replicated_kv_heads_compute_the_same_model(name):
    """Each declared module, replicated in one process: every query head
    still reads (a copy of) its own KV head, so the logits do not change."""
    model = archs.build_model(name)
    attribute = facts(name).kv_heads.attribute
    heads = [getattr(layer.self_attn, attribute) for layer in model.layers]
    tokens = archs.prompt_tokens(12)[None]
    before = model(tokens)
    ranks = 2 * min(heads)  # at most one KV head per query head, as sharding allows
    copies = replicate_kv_heads(model, ranks)
    assert any(c > 1 for c in copies)
    after_heads = [getattr(layer.self_attn, attribute) for layer in model.layers]
    assert after_heads == [h * c for h, c in zip(heads, copies, strict=True)]
    assert all(h % ranks == 0 for h in after_heads)
    after = model(tokens)
    assert mx.abs(after - before).max().item() < 1e-4


def test_sharding_is_checked_from_the_config_alone():
    """In one process (a group of 1): pipeline mode needs mlx-lm's pipeline();
    tensor mode returns the layout (every KV head on the only rank)."""
    with pytest.raises(UnsupportedKVConfig, match="gpt_oss cannot be split by layers"):
        check_sharding(tiny_model("gpt_oss"), pipeline=True)
    assert check_sharding(tiny_model("ministral3"), pipeline=True) is None
    layout = check_sharding(tiny_model("gpt_oss"), pipeline=False)
    assert layout.how == SPLIT and layout.kv_heads == layout.rank_kv_heads == (2, 2, 2, 2)
    assert "KV heads 2 per layer, 2 per rank over 1 ranks (split)" == layout.describe()


@pytest.mark.parametrize(
    "content, problem",
    [
        ("", "not JSON"),
        ("[127.0.0.1:5000]", "not JSON"),
        ("[]", "rank 0 has no address"),
        ('{"hosts": ["10.0.0.1:5000"]}', "rank 0 has no address"),
        ("[[], []]", "rank 0 has no address"),
        ("[[5000], [5001]]", "rank 0 has no address"),
    ],
)
def test_a_malformed_hostfile_fails_naming_the_file(tmp_path, monkeypatch, content, problem):
    """The heartbeat's leader address comes from MLX_HOSTFILE; a file that
    cannot be read that way fails startup (ValueError: exit 2) instead of
    falling back to another host in silence."""
    monkeypatch.delenv("MLX_KVQ_HEARTBEAT_HOST", raising=False)
    path = tmp_path / "hosts.json"
    path.write_text(content)
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    with pytest.raises(ValueError, match=problem) as e:
        env_leader_host()
    assert f"MLX_HOSTFILE={path}" in str(e.value)
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        env_leader_host()


@pytest.mark.parametrize(
    "content", ['[["10.0.0.7:5000", "10.0.0.7:5001"], ["10.0.0.8:5002"]]', '["10.0.0.7:5000"]']
)
def test_the_leader_is_rank_0_of_a_well_formed_hostfile(tmp_path, monkeypatch, content):
    monkeypatch.delenv("MLX_KVQ_HEARTBEAT_HOST", raising=False)
    (tmp_path / "hosts.json").write_text(content)
    monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    assert env_leader_host() == "10.0.0.7"


def non_default(hint, default=dataclasses.MISSING, salt: int = 0):
    """A value of type `hint` that differs from `default`, derived from the
    type alone (nested dataclasses and enums included), so a field added to a
    request is covered without editing this test."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return non_default(next(a for a in args if a is not type(None)), default, salt)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        values = {}
        for f in dataclasses.fields(hint):
            d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            values[f.name] = non_default(hints[f.name], d, salt)
        return hint(**values)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = [m for m in hint if m != default]
        return members[salt % len(members)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple(non_default(args[0], salt=salt + i) for i in range(2))
    if origin is tuple:
        return tuple(non_default(a, salt=salt + i) for i, a in enumerate(args))
    if origin is frozenset:
        return frozenset(non_default(args[0], salt=salt + i) for i in range(2))
    if hint is bool:
        return not default if isinstance(default, bool) else True
    if hint is int:
        return (default if isinstance(default, int) else 0) + 3 + salt
    if hint is float:  # a fraction, so that probabilities (top_p, min_p) stay valid
        return ((default if isinstance(default, float | int) else 0.0) + 0.375 + salt) % 1.0
    if hint is str:
        return f"s{salt}"
    raise AssertionError(f"no non-default value for {hint}: extend non_default")


def message_fields(cls) -> set[tuple[type, str]]:
    """Every (dataclass, field) reachable from `cls` through its type hints."""
    out, todo = set(), [cls]
    while todo:
        c = todo.pop()
        for f in dataclasses.fields(c):
            out.add((c, f.name))
            hint = typing.get_type_hints(c)[f.name]
            for t in (
                hint,
                *typing.get_args(hint),
                *sum(map(typing.get_args, typing.get_args(hint)), ()),
            ):
                if (
                    isinstance(t, type)
                    and dataclasses.is_dataclass(t)
                    and t not in {x for x, _ in out}
                ):
                    todo.append(t)
    return out


def test_every_request_field_survives_the_trip_to_the_other_ranks():
    """Rank 0's step commands, every field of every request set to a value
    other than its default, arrive equal; only `LOCAL_ONLY` (each with its
    reason) stays behind, and it names real fields."""
    commands = non_default(StepCommands)
    reached = message_fields(StepCommands)
    assert (GenerationRequest, "draft_tokens") in reached and (SamplingParams, "grammar") in reached
    assert set(LOCAL_ONLY) <= reached and all(LOCAL_ONLY.values()), LOCAL_ONLY
    for cls, name in reached - set(LOCAL_ONLY):  # really not the defaults
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        if f.default is not dataclasses.MISSING and cls is not StepCommands:
            sample = non_default(cls)
            assert getattr(sample, name) != f.default, (cls, name)
    arrived = commands_from_payload(commands_payload(commands))
    assert arrived == commands
    for request, got in zip(commands.submits, arrived.submits, strict=True):
        for cls, obj, other in (
            (GenerationRequest, request, got),
            (SamplingParams, request.params, got.params),
        ):
            for f in dataclasses.fields(cls):
                if (cls, f.name) not in LOCAL_ONLY:
                    assert getattr(other, f.name) == getattr(obj, f.name), f.name
                    assert type(getattr(other, f.name)) is type(getattr(obj, f.name)), f.name


def test_a_field_that_cannot_cross_is_refused_by_name():
    """A value that is not data (a callback) raises, naming the field,
    unless its field is declared local."""

    @dataclasses.dataclass(frozen=True)
    class WithCallback:
        n: int
        on_progress: typing.Callable | None = None

    with pytest.raises(TypeError, match="WithCallback.on_progress"):
        wire.encode(WithCallback(1, print))
    local = {(WithCallback, "on_progress"): "a callback of rank 0's HTTP handler"}
    assert wire.decode(WithCallback, wire.encode(WithCallback(1, print), local), local) == (
        WithCallback(1)
    )
