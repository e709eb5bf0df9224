"""Several models from one `mlx-kvq serve`: loaded on demand by name, resident
within one memory budget, every refusal naming the model.

Two tiny random-weight models (their greedy text is arbitrary, so equal
text means the same model answered) are served together and alone. Loads
are held back with the warm-up gate (`--warmup-gate DIR/gate-{model}`), so
that what happens during a load is decided by the test, not by timing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

from mlx_kvq.commands import main

KV = "8MiB"
MAX_TOKENS = 8
PROMPTS = ["Tell me about the sea.", "Count to five.", "Who are you?", "Name a city."]
WAIT_S = 120
CHAT = "/v1/chat/completions"


def gate_name(model: str) -> str:
    """The warm-up gate file of `model` (`serve.warmup_gate`'s spelling)."""
    return "gate-" + re.sub(r"\W", "_", model)


def chat(server, model: str, prompt: str = PROMPTS[0], timeout: float = WAIT_S) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    return httpx.post(server.url + CHAT, json=body, timeout=timeout)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def until(predicate, what: str):
    """Poll `predicate()` until it returns something true (bounded: a broken
    server fails the test instead of hanging it)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status(server, model: str | None = None) -> dict:
    params = {} if model is None else {"model": model}
    return httpx.get(server.url + "/status", params=params, timeout=10).json()


def models_of(server) -> dict[str, dict]:
    return {m["name"]: m for m in status(server)["models"]}


def overruns(server) -> float:
    """KV budget overruns counted by every model's engine."""
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("mlx_kvq_kv_budget_overruns_total"))


def weights(path: Path) -> int:
    """Bytes a model's weights take once loaded (from their shapes, nothing read)."""
    from mlx_kvq.commands.startup import ModelSource, load_weights
    from mlx_kvq.engine.budget import weights_bytes

    return weights_bytes(load_weights(ModelSource(str(path), "m"), argparse.Namespace(), lazy=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "alpha", "llama:sliding"), save_tiny_model(root / "beta", "llama")


@pytest.fixture(scope="module")
def alone(tiny) -> dict[str, list[str]]:
    """Each model's greedy text for every prompt, served alone."""
    texts = {}
    servers = {name: ServerProcess(path, "--kv-cache-memory", KV)
               for name, path in zip(("alpha", "beta"), tiny, strict=True)}  # fmt: skip
    try:
        for s in servers.values():
            s.start()
        for name, s in servers.items():
            s.wait_ready()
            texts[name] = [text_of(chat(s, "default_model", p)) for p in PROMPTS]
    finally:
        for s in servers.values():
            s.stop()
    assert texts["alpha"] != texts["beta"]
    return texts


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    """alpha (`--model`, the default) and beta (a models file: name, alias, its
    own flags), beta's first load held back until the test opens its gate."""
    alpha, beta = tiny
    root = tmp_path_factory.mktemp("pair")
    (root / gate_name(str(alpha))).touch()
    models_file = root / "models.json"
    models_file.write_text(json.dumps({"models": [
        {"name": "beta", "model": str(beta), "aliases": ["claude-3-5-haiku"],
         "flags": f"--kv-cache-memory {KV} --max-tokens 5"},
    ]}))  # fmt: skip
    args = ("--models-file", str(models_file), "--kv-cache-memory", KV,
            "--warmup-gate", str(root / "gate-{model}"))  # fmt: skip
    with ServerProcess(alpha, *args, env={"HF_HUB_OFFLINE": "1"}) as s:
        s.wait_ready()
        s.gates = root
        yield s
        assert overruns(s) == 0


@pytest.fixture
def beta_ready(pair):
    (pair.gates / gate_name("beta")).touch()
    until(lambda: models_of(pair)["beta"]["status"] == "ready", "beta ready")
    return pair


# ---------------------------------------------------------------- startup refusals
def refused(capsys, *argv: str) -> str:
    assert main(["serve", "--port", "0", *argv]) == 2
    return capsys.readouterr().err


def test_declared_models_are_checked_at_startup(tiny, tmp_path, capsys):
    alpha, beta = tiny
    bad = tmp_path / "models.json"
    cases = [
        ({"models": [{"model": str(beta), "pin": True}]}, "unknown keys ['pin']"),
        ({"models": [{"name": "b", "model": str(beta), "flags": "--port 9"}]},
         "(b): --port is the whole server's, not one model's"),
        ({"models": [{"name": "b", "model": str(beta), "flags": "--kv-bits 7"}]}, "--kv-bits"),
        ({"models": [{"name": "b", "model": str(beta), "aliases": ["x"]},
                     {"name": "c", "model": str(beta), "aliases": ["x"]}]},
         "the name 'x' is given to two models: 'b' and 'c'"),
        ({"models": [{"name": "gone", "model": str(tmp_path / "nowhere")}]},
         "model 'gone': no model directory"),
        ({"default": "z", "models": [{"model": str(beta)}]}, "the default 'z' is not one of"),
    ]  # fmt: skip
    for body, message in cases:
        bad.write_text(json.dumps(body))
        assert message in refused(capsys, "--model", str(alpha), "--models-file", str(bad))
    err = refused(capsys, "--model", str(alpha), "--kv-cache-memory", KV, "--models-memory", "1MiB")
    assert f"the default model '{alpha}' holds" in err and "--models-memory" in err


# ---------------------------------------------------------------- loading on request
def test_first_requests_share_one_load_that_stalls_no_one_and_survives_a_client_leaving(
    pair, tiny, alone
):
    alpha, _ = tiny
    assert {m["id"]: m["status"] for m in pair.client().models.list().model_dump()["data"]} == {
        str(alpha): "ready",
        "beta": "available",
    }
    answers: dict[int, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda i=i: answers.setdefault(i, chat(pair, "beta", PROMPTS[i])))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    until(lambda: models_of(pair)["beta"]["status"] == "loading", "beta loading")
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up during the load
        chat(pair, "beta", timeout=1.0)
    # the resident model answers while beta loads, and beta is not ready yet
    assert text_of(chat(pair, str(alpha), PROMPTS[0])) == alone["alpha"][0]
    health = httpx.get(pair.url + "/health", params={"model": "beta"}, timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "loading"
    assert httpx.get(pair.url + "/health", timeout=10).status_code == 200
    (pair.gates / gate_name("beta")).touch()
    for t in threads:
        t.join(WAIT_S)
    for i in range(3):
        assert answers[i].json()["model"] == "beta"
        assert text_of(answers[i]) == alone["beta"][i]
    m = pair.metrics()
    assert m['mlx_kvq_model_loads_total{model="beta"}'] == 1
    assert m['mlx_kvq_model_resident{model="beta"}'] == 1
    until(lambda: pair.metrics().get(
        f'mlx_kvq_requests_total{{model="{alpha}",status="cancelled"}}', 0) >= 1,
        "the client that left counted")  # fmt: skip


def test_sixteen_openai_clients_alternating_get_each_its_own_model(beta_ready, tiny, alone):
    """Streamed and not, at once: each answer is its model's text served alone."""
    pair, (alpha, _) = beta_ready, tiny
    client = pair.client()
    names = {"alpha": str(alpha), "beta": "beta"}
    results: dict[int, tuple[str, str]] = {}
    errors = []
    start = threading.Barrier(16)

    def run(i: int) -> None:
        model, prompt, stream = ("alpha", "beta")[i % 2], i // 2 % len(PROMPTS), i // 4 % 2 == 1
        kw = dict(model=names[model], messages=[{"role": "user", "content": PROMPTS[prompt]}],
                  temperature=0, stream=stream, max_tokens=MAX_TOKENS)  # fmt: skip
        try:
            start.wait(WAIT_S)
            if stream:
                chunks = list(client.chat.completions.create(**kw))
                served = {c.model for c in chunks}
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                r = client.chat.completions.create(**kw)
                served, text = {r.model}, r.choices[0].message.content
            results[i] = (model, prompt, served, text)
        except Exception as e:  # reported with the client's number
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    assert len(results) == 16
    for model, prompt, served, text in results.values():
        assert (served, text) == ({names[model]}, alone[model][prompt])
    assert pair.metrics()['mlx_kvq_model_loads_total{model="beta"}'] == 1


def test_anthropic_and_responses_route_by_model(beta_ready, tiny):
    pair, (alpha, _) = beta_ready, tiny
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for name, served in (("claude-3-5-haiku", "beta"), ("claude-sonnet-4-5", str(alpha))):
        r = httpx.post(pair.url + "/v1/messages", json={**body, "model": name}, timeout=WAIT_S)
        assert r.status_code == 200 and r.json()["model"] == served, r.text
    r = httpx.post(
        pair.url + "/v1/responses",
        json={"model": "beta", "input": "hi", "max_output_tokens": 4},
        timeout=WAIT_S,
    )
    assert r.status_code == 200 and r.json()["model"] == "beta", r.text
    assert pair.client().models.retrieve("claude-3-5-haiku").id == "beta"


def test_a_model_that_cannot_load_is_a_4xx_naming_it_and_the_others_serve(
    beta_ready, tiny, tmp_path, alone
):
    pair, (alpha, _) = beta_ready, tiny
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((alpha / "config.json").read_text())
    unknown = tmp_path / "unknown-type"
    unknown.mkdir()
    config = json.loads((alpha / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
    for name, status_code, code in (
        (str(no_weights), 400, "model_not_loadable"),
        (str(unknown), 400, "model_not_loadable"),
        ("no-org/no-such-model", 400, "model_not_loadable"),  # a repo id: no hub here
        ("gpt-4o", 404, "model_not_found"),
    ):
        r = chat(pair, name)
        assert r.status_code == status_code, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == (code, "model")
        assert f"'{name}'" in error["message"], error["message"]
    assert text_of(chat(pair, "beta", PROMPTS[1])) == alone["beta"][1]
    assert text_of(chat(pair, "default_model", PROMPTS[1])) == alone["alpha"][1]
    assert list(models_of(pair)) == [str(alpha), "beta"]  # names that failed are not kept


def test_probes_and_the_page_report_each_model(beta_ready, tiny):
    pair, (alpha, _) = beta_ready, tiny
    health = httpx.get(pair.url + "/health", params={"model": "beta"}, timeout=10).json()
    assert health["status"] == "ok" and health["model"] == "beta"
    assert health["plan"]["kv_layers"] == 2
    whole = httpx.get(pair.url + "/health", timeout=10).json()
    assert whole["model"] == str(alpha) and whole["models"]["beta"]["status"] == "ready"
    beta = status(pair, "claude-3-5-haiku")
    assert beta["model"] == "beta" and beta["defaults"]["max_tokens"] == 5
    assert beta["budget"]["bytes"] == 8 << 20
    memory = beta["models_memory"]
    assert 0 < memory["held"] <= memory["budget"] and memory["held_max"] <= memory["budget"]
    assert memory["held"] == sum(m["weights_bytes"] + m["kv_budget_bytes"]
                                 for m in beta["models"] if m["weights_bytes"])  # fmt: skip
    m = pair.metrics()
    assert m[f'mlx_kvq_ready{{model="{alpha}"}}'] == m['mlx_kvq_ready{model="beta"}'] == 1
    assert m['mlx_kvq_model_kv_budget_bytes{model="beta"}'] == 8 << 20


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver = (
        shutil.which("chromium") or shutil.which("chromium-browser"),
        shutil.which("chromedriver"),
    )
    pytest.importorskip("selenium", reason="selenium (pip install -e '.[test]')")
    if not (chromium and driver):
        pytest.skip("chromium and chromedriver not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"):  # fmt: skip
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    browser = webdriver.Chrome(options=options, service=Service(driver))
    yield browser
    browser.quit()


def test_the_page_talks_to_the_model_picked(beta_ready, tiny, alone, browser):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    pair, (alpha, _) = beta_ready, tiny

    def wait(condition, what):
        return WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(condition, message=what)

    browser.get(pair.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(pair.url + "/")
    picker = wait(lambda d: d.find_element("id", "model-picker").is_displayed()
                  and d.find_element("id", "model-picker"), "the model picker")  # fmt: skip
    options = [o.text for o in Select(picker).options]
    assert options == [f"{alpha} (default): ready", "beta: ready"]
    Select(picker).select_by_value("beta")
    wait(lambda d: "2/2 KV layers" in d.find_element("id", "plan-summary").text, "beta's plan")
    for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        box = browser.find_element("id", field)
        box.clear()
        box.send_keys(value, Keys.TAB)
    browser.find_element("id", "input").send_keys(PROMPTS[3], Keys.ENTER)
    kept = "return JSON.parse(localStorage.getItem('mlx-kvq.chat')).messages"
    messages = wait(lambda d: len(m := d.execute_script(kept)) == 2 and m[1]["content"]
                    and d.find_elements("css selector", "#messages li.assistant[data-done=true]")
                    and d.execute_script(kept), "the answer")  # fmt: skip
    assert messages[1]["content"] == alone["beta"][3]


# ---------------------------------------------------------------- one memory budget
@pytest.fixture(scope="module")
def crowded(tiny, tmp_path_factory):
    """alpha and beta where one fits, their prompt caches on disk: alpha's
    first warm-up held back (a request waiting for it holds alpha)."""
    alpha, beta = tiny
    root = tmp_path_factory.mktemp("crowded")
    (root / gate_name(str(beta))).touch()
    kv = 8 << 20
    one = max(weights(alpha), weights(beta)) + kv
    budget = one + (min(weights(alpha), weights(beta)) + kv) // 2  # one fits, never both
    args = ("--model", str(beta), "--kv-cache-memory", KV, "--models-memory", str(budget),
            "--model-wait", "1", "--warmup-gate", str(root / "gate-{model}"),
            "--prompt-cache-dir", str(root / "disk"))  # fmt: skip
    with ServerProcess(alpha, *args) as s:
        s.wait_for("/live")
        s.gates, s.budget = root, budget
        yield s
        assert overruns(s) == 0


def test_no_room_is_503_naming_the_model_then_the_idle_one_is_evicted_and_reloaded(
    crowded, tiny, alone
):
    server, (alpha, beta) = crowded, tiny
    waiting: dict[str, httpx.Response] = {}
    held = threading.Thread(target=lambda: waiting.setdefault("r", chat(server, str(alpha))))
    held.start()  # alpha still warms up: this request holds it
    until(lambda: models_of(server)[str(alpha)]["requests"] == 1, "alpha's request routed")
    r = chat(server, str(beta))
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_busy", "model")
    assert (
        f"model '{beta}' needs" in error["message"] and f"'{alpha}' (1 request)" in error["message"]
    )
    (server.gates / gate_name(str(alpha))).touch()
    held.join(WAIT_S)
    assert text_of(waiting["r"]) == alone["alpha"][0]
    assert text_of(chat(server, str(beta), PROMPTS[2])) == alone["beta"][2]  # alpha evicted
    listed = models_of(server)
    assert (listed[str(alpha)]["status"], listed[str(alpha)]["evictions"]) == ("available", 1)
    assert listed[str(alpha)]["weights_bytes"] is None
    assert text_of(chat(server, str(alpha), PROMPTS[0])) == alone["alpha"][0]  # reloaded
    m = server.metrics()
    assert m[f'mlx_kvq_model_loads_total{{model="{alpha}"}}'] == 2
    assert m[f'mlx_kvq_model_evictions_total{{model="{beta}"}}'] == 1
    assert m["mlx_kvq_models_bytes_held_max"] <= m["mlx_kvq_models_memory_bytes"] == server.budget


def test_eviction_under_load_answers_every_request_with_its_own_model(crowded, tiny, alone):
    """Clients alternating between two models that never fit together: each
    waits for the other's requests to end (or is told to retry, and does, as
    the openai client does with Retry-After), and gets its own model's text."""
    server, (alpha, beta) = crowded, tiny
    (server.gates / gate_name(str(alpha))).touch()
    client = server.client(max_retries=10)
    names = {"alpha": str(alpha), "beta": str(beta)}
    results, errors = {}, []

    def run(i: int) -> None:
        model, prompt = ("alpha", "beta")[i % 2], i // 2 % len(PROMPTS)
        try:
            r = client.chat.completions.create(
                model=names[model], messages=[{"role": "user", "content": PROMPTS[prompt]}],
                max_tokens=MAX_TOKENS, temperature=0,
            )  # fmt: skip
            results[i] = (
                r.model == names[model],
                r.choices[0].message.content == alone[model][prompt],
            )
        except openai.APIError as e:
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors, errors
    assert results == {i: (True, True) for i in range(8)}
    m = server.metrics()
    assert m["mlx_kvq_models_bytes_held_max"] <= server.budget
    assert m[f'mlx_kvq_model_evictions_total{{model="{alpha}"}}'] >= 1


def test_an_evicted_models_prompt_cache_is_read_back_from_disk(crowded, tiny):
    server, (alpha, beta) = crowded, tiny
    (server.gates / gate_name(str(alpha))).touch()
    long_prompt = "A cache keeps recent results close at hand, so work is not done twice. " * 10

    def complete(model: str) -> dict:
        body = {"model": model, "prompt": long_prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        return r.json()

    def disk() -> dict:
        return status(server, str(alpha))["prompt_cache_disk"]

    first = complete(str(alpha))
    until(lambda: (d := disk()) and d["writes"] and not d["queued_bytes"], "alpha's files written")
    text_of(chat(server, str(beta)))  # alpha is evicted for beta
    assert models_of(server)[str(alpha)]["status"] == "available"
    again = complete(str(alpha))  # reloaded: its prefix comes back from disk
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert disk()["hits"] >= 1


def test_an_evicted_model_leaves_memory(tiny):
    """Eviction lets the model go: nothing (a plan cache, a service) keeps its
    weights once its engine stopped."""
    import gc
    import weakref

    import mlx.core as mx

    from mlx_kvq.commands import build_parser
    from mlx_kvq.commands.serve import ModelsMemory, ServeLoader
    from mlx_kvq.residency import Lease, ModelEntry, ModelPool

    alpha, beta = (str(p) for p in tiny)
    args = build_parser().parse_args(["serve", "--model", alpha, "--kv-cache-memory", KV])
    memory = ModelsMemory(max(weights(p) for p in tiny) + (9 << 20), "one of them", 2)
    pool = ModelPool(memory.budget, ServeLoader(args, memory, declared_only=True), wait_s=30)
    for path in (alpha, beta):
        options = argparse.Namespace(**{**vars(args), "model": path})
        pool.declare(ModelEntry(path, path, options=options))

    def resident(name: str):
        for _ in range(3):
            ticket = pool.claim(name)
            if isinstance(ticket, Lease):
                ticket.release()
                return ticket.loaded
            ticket.result(WAIT_S)
        raise AssertionError(f"{name} never became resident")

    try:
        gone, active = [], []
        for name in (alpha, beta, alpha, beta):
            loaded = resident(name)
            gone.append((weakref.ref(loaded.engine), weakref.ref(loaded.engine.runner.model)))
            del loaded
            gc.collect()
            active.append(mx.get_active_memory())
        assert [v.evictions for v in pool.views()] == [2, 1]
        assert all(e() is None and m() is None for e, m in gone[:-1])
        assert active[3] <= active[1] + (1 << 20)  # beta again: no more held than the first time
    finally:
        pool.close("test over")
        pool.stop()


def test_which_undeclared_names_load(tiny, tmp_path):
    from mlx_kvq.commands import build_parser
    from mlx_kvq.commands.serve import ModelsMemory, ServeLoader
    from mlx_kvq.commands.serve_models import undeclared

    alpha, _ = tiny
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert undeclared(str(alpha), hub=False) and undeclared(str(tmp_path / "m.gguf"), hub=False)
    assert undeclared("demo:full", hub=False) and not undeclared("demo:nonesuch", hub=True)
    assert undeclared("org/model", hub=True) and not undeclared("org/model", hub=False)
    assert not undeclared("gpt-4o", hub=True) and not undeclared(str(tmp_path), hub=True)
    args = build_parser().parse_args(["serve"])
    memory = ModelsMemory(1 << 30, "test")
    entry = ServeLoader(args, memory, declared_only=False).named(str(alpha), hub=True)
    assert (entry.name, entry.location, entry.declared) == (str(alpha), str(alpha), False)
    assert entry.options.model == str(alpha) and entry.options.adapter_path is None
    assert ServeLoader(args, memory, declared_only=True).named(str(alpha), hub=True) is None
