"""`mlx-kvq bench --sections agents`: coding-agent sessions against both
servers. The counts it reports are checked against hand-made histories
(tokens shared, reuse read from `usage`), and the section runs end to end on
a scripted model whose answers are known. Timings are never asserted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kvq_testing.scripted import save_scripted_model

from mlx_kvq.bench import agents_bench as ab
from mlx_kvq.bench import report
from mlx_kvq.bench.settings import BenchSettings
from mlx_kvq.commands import main

ANSWER = ["Read", " the", " file", " again."]  # the scripted model's every answer: 4 tokens


def _sources(tmp_path):
    folder = tmp_path / "sources"
    folder.mkdir()
    for stem in ("alpha", "beta", "gamma"):  # functions named after their file: no slice repeats
        body = "".join(f"def {stem}_{i}(x):\n    return x + {i}\n\n\n" for i in range(200))
        (folder / f"{stem}.py").write_text(f"# {stem}.py\n{body}")
    return folder


class CharTokenizer:
    """One token per character, a BOS first when special tokens are asked for:
    counts that can be worked out by hand."""

    BOS = 1
    eos_token_id = 2
    has_chat_template = False
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.BOS] if add_special_tokens else []) + [ord(c) for c in text]


def test_tokens_shared_on_a_hand_made_history():
    sent = [
        ab.Sent((1, 2, 3, 4), (9, 9), sent=0.0, done=1.0),  # session A, turn 1
        ab.Sent((1, 2, 3, 7, 8), (5,), sent=0.5, done=1.2),  # session B, turn 1
        # A, turn 2, sent after A's first answer: its prompt and answer, then more
        ab.Sent((1, 2, 3, 4, 9, 9, 6, 6), (), sent=1.5, done=2.0),
        # the same prompt again: all of it but the last token
        ab.Sent((1, 2, 3, 4, 9, 9, 6, 6), (), sent=2.5, done=3.0),
        # sent while B's answer was still streaming: B's answer is not counted
        ab.Sent((1, 2, 3, 7, 8, 5, 0), (), sent=1.1, done=1.3),
        # a rewrite: only what comes before the cleared tool result is shared
        ab.Sent((1, 2, 3, 4, 0, 0, 0, 0, 0), (), sent=4.0, done=5.0),
        # nothing earlier shares its first token
        ab.Sent((2, 2), (), sent=6.0, done=7.0),
    ]
    assert ab.tokens_shared(sent) == [0, 3, 6, 7, 5, 4, 0]


def _exchange(workload, session, turn, answers, sent, usage):
    body = workload.request(session, answers[:turn])
    return ab.Exchange(session, turn, body, sent, 0.1 * (turn + 1), sent + 0.5,
                       answers[turn], "length", usage)  # fmt: skip


def _small_settings(tmp_path, **changes) -> BenchSettings:
    small = dict(
        agent_sessions=2, agent_turns=3, agent_system=120, agent_tool_chars=80,
        agent_tokens=8, agent_rewrite=3, agent_sources=str(_sources(tmp_path)),
    )  # fmt: skip
    return replace(BenchSettings(), **(small | changes))


def test_the_summary_reads_reuse_from_usage_and_shares_what_the_history_repeats(tmp_path):
    tok = CharTokenizer()
    workload = ab.build_workload(_small_settings(tmp_path), tok)
    assert workload.api is ab.Api.COMPLETIONS and "no chat template" in workload.api_reason
    assert workload.system_tokens <= 120 and len(workload.system) == workload.system_tokens
    answers = [[" yes", " no", " maybe"], [" ok", " fine", " done"]]
    exchanges, t = [], 0.0
    for turn in range(3):
        for s in range(2):
            body = workload.request(s, answers[s][:turn])
            n = len(tok.encode(body["prompt"]))
            usage = {"prompt_tokens": n, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 10 * turn + s}}  # fmt: skip
            exchanges.append(_exchange(workload, s, turn, answers[s], t, usage))
            t += 1.0
    run = ab.ArmRun(12.5, tuple(exchanges), 300 << 20, 310 << 20, (None, None))
    f = ab.summarize(run, tok, workload)
    prompts = [tok.encode(e.body["prompt"]) for e in exchanges]
    assert f["prompt_tokens"] == f["server_prompt_tokens"] == sum(map(len, prompts))
    assert f["prompt_tokens_agree"]
    assert f["cached_tokens"] == sum(10 * turn + s for turn in range(3) for s in range(2))
    assert f["cached_reported"] == 6
    shared = [r["shared"] for r in f["requests_detail"]]
    # turn 1: the first request shares the BOS with the server's warm-up request; the
    # second the BOS, the system prompt and the turn up to the tool results' first difference
    first_a, first_b = prompts[0], prompts[1]
    lcp = next(i for i, (a, b) in enumerate(zip(first_a, first_b, strict=False)) if a != b)
    assert shared[:2] == [1, lcp] and lcp > workload.system_tokens
    # turn 2: the previous prompt and its answer, exactly
    assert shared[2:4] == [len(prompts[0]) + len(answers[0][0]),
                           len(prompts[1]) + len(answers[1][0])]  # fmt: skip
    assert prompts[2][: shared[2]] == prompts[0] + [ord(c) for c in answers[0][0]]
    # turn 3 rewrites the first tool result: less is shared than the first prompt held
    assert all(lcp <= x < len(prompts[0]) for x in shared[4:])
    assert "[tool output cleared" in exchanges[4].body["prompt"]
    assert f["shared_tokens"] == sum(shared)
    assert f["reused_of_shared"] == pytest.approx(f["cached_tokens"] / f["shared_tokens"])
    assert [r["shared"] for r in f["by_turn"]] == [sum(shared[0:2]), sum(shared[2:4]),
                                                   sum(shared[4:6])]  # fmt: skip
    assert f["ttft_mean_s"] == pytest.approx(0.2) and f["ttft_p90_s"] == pytest.approx(0.3)
    assert f["peak_rss_bytes"] == 300 << 20
    # an answer that stopped was followed by the EOS token in what the server generated
    stopped = replace(exchanges[0], finish_reason="stop")
    assert ab.answer_ids(tok, stopped) == [ord(c) for c in " yes"] + [tok.eos_token_id]
    assert ab.answer_ids(tok, exchanges[0]) == [ord(c) for c in " yes"]
    # a server that reports no cached tokens: said so, not counted as zero
    silent = [replace(e, usage={"prompt_tokens": 1, "completion_tokens": 2}) for e in exchanges]
    g = ab.summarize(replace(run, exchanges=tuple(silent)), tok, workload)
    assert g["cached_tokens"] is None and g["reused_of_shared"] is None
    assert g["cached_reported"] == 0 and not g["prompt_tokens_agree"]
    assert ab.same_answers(g, f) == {"same": 6, "of": 6}


def test_the_history_grows_by_each_answer_and_the_rewrite_clears_the_first_result(tmp_path):
    tok = CharTokenizer()
    settings = _small_settings(tmp_path, agent_turns=4)
    text = ab.build_workload(settings, tok)
    chat = replace(text, api=ab.Api.CHAT)
    first = text.results[0][0]
    # distinct slices per session and turn, the same in every build
    names = [r for row in text.results for r in row]
    assert len(set(names)) == len(names) == 8
    assert ab.build_workload(settings, tok) == text
    prompts = [text.request(0, [" a", " b", " c"][:turn])["prompt"] for turn in range(4)]
    # each prompt is the one before, its answer exactly as returned, and the next turn
    assert prompts[1].startswith(prompts[0] + " a") and first.source in prompts[1]
    assert prompts[3].startswith(prompts[2] + " c")
    # from turn 3 on, the first tool result is a placeholder; the rest is kept
    assert first.source not in prompts[2] and first.cleared() in prompts[2]
    assert text.results[0][1].source in prompts[2] and prompts[2].count(ab.PLACEHOLDER) == 1
    assert prompts[2].startswith(prompts[1].split(first.source)[0].rsplit(":", 1)[0])
    messages = chat.request(1, [" a", " b"])["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant", "user"]  # fmt: skip
    assert messages[2]["content"] == " a" and ab.PLACEHOLDER in messages[1]["content"]
    assert chat.request(1, [" a"])["messages"][1]["content"].startswith(chat.results[1][0].text())


@pytest.mark.parametrize("api", ["auto", "completions"])
def test_agents_section_runs_both_servers_end_to_end(tmp_path, api):
    model = save_scripted_model(tmp_path / "model", {}, default=ANSWER, template="plain",
                                arch="hybrid")  # fmt: skip
    chat = api == "auto"  # the scripted model has a chat template
    arms = "default" if chat else "default;--kv-bits 0"
    rc = main(
        ["bench", "--sections", "agents", "--model", str(model), "--agent-arms", arms,
         "--agent-sessions", "2", "--agent-turns", "3", "--agent-system", "200",
         "--agent-tool-chars", "120", "--agent-tokens", "8", "--agent-rewrite", "3",
         "--agent-api", api, "--agent-sources", str(_sources(tmp_path)), "--no-plots",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    out = json.loads((tmp_path / "bench.json").read_text())["agents"]
    names = ["mlx_lm.server", "mlx-kvq default"] + ([] if chat else ["mlx-kvq --kv-bits 0"])
    assert list(out["arms"]) == names
    assert out["api"] == ("/v1/chat/completions" if chat else "/v1/completions")
    assert out["workload"]["system_tokens"] <= 200
    for n in names:
        f = out["arms"][n]
        rows = f["requests_detail"]
        assert f["requests"] == len(rows) == 6
        # the servers counted the prompts as the client did, and said every answer
        assert f["prompt_tokens_agree"]
        assert all(r["answer"] == "".join(ANSWER) for r in rows)
        # (mlx_lm.server counts the EOS among the completion tokens)
        assert all(r["completion_tokens"] in (len(ANSWER), len(ANSWER) + 1) for r in rows)
        assert f["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
        by = {(r["session"], r["turn"]): r for r in rows}
        for s in (1, 2):
            # turn 2 extends turn 1's prompt and its answer (4 tokens, then the EOS
            # where the chat template renders it after the answer)
            assert by[s, 1]["finish_reason"] == "stop"
            answer = len(ANSWER) + (1 if chat else 0)
            assert by[s, 2]["shared"] == by[s, 1]["prompt_tokens"] + answer
            # turn 3 cleared the first tool result: less than turn 1's prompt is shared
            assert by[s, 3]["shared"] < by[s, 1]["prompt_tokens"]
        # reuse comes from each answer's usage, within the prompt
        assert f["cached_reported"] == 6
        assert f["cached_tokens"] == sum(r["cached"] for r in rows)
        assert all(0 <= r["cached"] <= r["prompt_tokens"] for r in rows)
        assert f["shared_tokens"] == sum(r["shared"] for r in rows)
        assert f["blas"] and f["wall_s"] > 0 and f["ttft_p90_s"] >= f["ttft_mean_s"] > 0
        assert f["peak_rss_bytes"] is None or f["peak_rss_bytes"] > 0
    for n in names[1:]:
        assert out["arms"][n]["same_answers"] == {"same": 6, "of": 6}
        ratio = out["arms"][n]["vs_baseline"]["wall_speedup"]
        assert ratio == pytest.approx(out["arms"][names[0]]["wall_s"] / out["arms"][n]["wall_s"])
    goals = [g["goal"] for g in report.goals({"agents": out})]
    assert any("reused / tokens shared" in g for g in goals)
    assert any("mean time to first token" in g for g in goals)
    if chat:
        assert out["unquantized_arm"] is None and "vs_unquantized" not in out["arms"][names[1]]
    else:  # the default against --kv-bits 0, in the same run
        assert out["unquantized_arm"] == "mlx-kvq --kv-bits 0"
        assert out["arms"][names[2]]["vs_unquantized"]["wall_speedup"] == 1.0
        assert any("vs mlx-kvq --kv-bits 0" in g for g in goals)
    md = (tmp_path / "bench.md").read_text()
    assert "## Agent sessions" in md and "3 (rewrite)" in md


def test_a_workload_past_the_models_context_is_refused_before_any_server_starts(tmp_path, capsys):
    model = save_scripted_model(tmp_path / "model", {}, default=ANSWER, template="plain")
    rc = main(
        ["bench", "--sections", "agents", "--model", str(model), "--agent-turns", "40",
         "--agent-rewrite", "0", "--agent-tool-chars", "1000",
         "--agent-sources", str(_sources(tmp_path)), "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2 and "max_position_embeddings" in captured.err
    assert "ready after" not in captured.out  # refused before any server


def test_a_rewrite_turn_outside_the_sessions_is_refused(tmp_path, capsys):
    rc = main(
        ["bench", "--sections", "agents", "--model", "demo:gemma", "--agent-turns", "3",
         "--agent-rewrite", "5", "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 2 and "--agent-rewrite 5" in capsys.readouterr().err
