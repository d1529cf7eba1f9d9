"""``continuumlm serve`` held to the official ``openai`` client: completions streamed and
not, equal to ``continuumlm generate``; concurrent requests equal to each alone; the depth per
request; every bad input refused with its status while the server keeps answering; a client
that goes away freed; SIGTERM and SIGINT draining to exit 0; lm-evaluation-harness's
``local-completions`` scoring as the in-process harness does."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import run_cli, write_tiny_corpus

openai = pytest.importorskip("openai")  # the [dev] extra installs it (CI's)
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")

from continuumlm import load_config  # noqa: E402
from continuumlm.runs import load_model_and_tokenizer  # noqa: E402
from continuumlm.serve.server import make_server  # noqa: E402
from continuumlm.train import Trainer  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small ODE model trained 80 steps on a generated text (its greedy text varies)."""
    corpus = write_tiny_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt")
    out = tmp_path_factory.mktemp("serve") / NAME
    Trainer(load_config(None, [
        "data.dataset=text", f'data.path="{corpus}"', "model.hidden_size=32",
        "model.num_heads=2", "model.num_layers=1", "model.depth=ode", "model.dropout=0.0",
        "model.ode_solver=rk4", "model.ode_steps=2", "model.position=rope",
        "model.max_seq_len=128", "train.batch_size=8", "train.seq_len=32",
        "train.max_steps=80", "train.lr_decay_steps=80", "train.warmup_steps=2",
        "train.lr=1e-2", "train.eval_interval=80", "train.eval_iters=2",
        "train.checkpoint_interval=80", "train.device=cpu", "train.seed=3"]),
        out, quiet=True).run()
    return out


class Running:
    def __init__(self, run, **kw):
        model, tok, _ = load_model_and_tokenizer(run, "best")
        self.model, self.tok = model, tok
        self.server, self.engine = make_server(model, tok, model_name=NAME, port=0,
                                               quiet=True, **kw)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def post(self, path, body=None, data=None, **kw):
        return requests.post(self.url + path, json=body, data=data, timeout=60, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def srv(run_dir):
    s = Running(run_dir, max_batch=8)
    yield s
    s.stop()


def generated(run, prompt, n, *extra):
    r = run_cli("generate", "--checkpoint", run, "--prompt", prompt, "--max-new-tokens", n,
                *extra)
    assert r.returncode == 0, r.stderr
    return r.stdout[len(prompt):].rstrip("\n")  # the command ends its text with a newline


def test_completions_equal_generate_streamed_or_not(srv, run_dir):
    want = generated(run_dir, "the cat", 40, "--greedy")
    r = srv.client.completions.create(model=NAME, prompt="the cat", max_tokens=40,
                                      temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert len(set(want)) > 3  # not one character repeated
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 40)
    assert r.usage.field_evaluations_per_token == 8.0  # rk4 x 2, one block
    chunks = list(srv.client.completions.create(
        model=NAME, prompt="the cat", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40


def test_a_lone_client_decodes_through_the_lean_step_unless_no_lean(run_dir, monkeypatch):
    """A request to an idle server decodes alone through the lean step (as generate does);
    --no-lean (lean=False) batches it; the text is generate's either way."""
    import continuumlm.serve.engine as E
    import continuumlm.serve.server as S

    lone = []
    real = E.start_lone
    monkeypatch.setattr(E, "start_lone", lambda engine, req: lone.append(real(engine, req))
                        or lone[-1])
    want = generated(run_dir, "the dog", 30, "--greedy")
    for lean in (True, False):
        s = Running(run_dir, lean=lean)
        try:
            r = s.client.completions.create(model=NAME, prompt="the dog", max_tokens=30,
                                            temperature=0)
            assert r.choices[0].text == want
            assert r.usage.field_evaluations_per_token == 8.0
        finally:
            s.stop()
        assert lone == [True], lean  # lone on the first server; the second never tries
    seen = {}
    monkeypatch.setattr(S, "serve", lambda model, tokenizer, **kw: seen.update(kw) or 0)
    assert run_cli("serve", "--checkpoint", run_dir).returncode == 0 and seen["lean"] is True
    assert run_cli("serve", "--checkpoint", run_dir, "--no-lean").returncode == 0
    assert seen["lean"] is False


def test_a_seeded_sample_draws_as_generate_does(srv, run_dir):
    want = generated(run_dir, "a mat", 30, "--seed", 7, "--temperature", 0.8, "--top-k", 10)
    r = srv.client.completions.create(model=NAME, prompt="a mat", max_tokens=30, seed=7,
                                      temperature=0.8, extra_body={"top_k": 10})
    assert r.choices[0].text == want


def test_sixteen_concurrent_requests_each_equal_the_request_alone(srv):
    prompts = [f"{w} {v}" for w in ("the", "a", "gamma", "sat") for v in ("cat", "mat", "on",
                                                                           "delta")]
    sizes = [5 + 3 * i for i in range(16)]

    def ask(i):
        r = srv.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=sizes[i],
                                          temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    assert srv.engine.turns > 0
    for i in range(16):
        assert together[i] == ask(i)  # alone: nothing else is running now


def test_n_choices_logprobs_and_echo(srv):
    r = srv.post("/v1/completions", {"model": NAME, "prompt": ["the", "on a"], "n": 2,
                                     "max_tokens": 3, "temperature": 1.0, "seed": 1})
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ids = srv.tok.encode("the cat")
    r = srv.post("/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 0,
                                     "echo": True, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["text"] == "the cat"
    with torch.no_grad():
        want = torch.log_softmax(srv.model(torch.tensor([ids]))[0][0].double(), -1)
    assert lp["token_logprobs"][0] is None and lp["tokens"] == list("the cat")
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-5)
    assert lp["text_offset"] == list(range(len(ids)))


def test_the_depth_is_chosen_per_request(srv):
    r = srv.client.completions.create(model=NAME, prompt="the", max_tokens=5, temperature=0,
                                      extra_body={"ode_solver": "euler", "ode_steps": 1})
    assert r.usage.field_evaluations_per_token == 1.0
    r = srv.client.completions.create(model=NAME, prompt="the", max_tokens=5, temperature=0,
                                      extra_body={"exit_threshold": 1e9})
    assert r.usage.field_evaluations_per_token < 8
    drafted = srv.client.completions.create(
        model=NAME, prompt="the cat", max_tokens=20, temperature=0,
        extra_body={"draft": {"solver": "euler", "steps": 1, "tokens": 3}})
    plain = srv.client.completions.create(model=NAME, prompt="the cat", max_tokens=20,
                                          temperature=0)
    assert drafted.choices[0].text == plain.choices[0].text
    sure = srv.client.completions.create(
        model=NAME, prompt="the cat", max_tokens=20, temperature=0,
        extra_body={"draft": {"solver": "euler", "tokens": 6, "confidence": 0.3}})
    assert sure.choices[0].text == plain.choices[0].text
    for extra, field in [({"ode_solver": "dopri5"}, "ode_solver"),
                         ({"draft": {"solver": "euler", "confidence": 1.0}}, "draft"),
                         ({"ode_solver": "nope"}, "ode_solver"),
                         ({"exit_threshold": 0.1, "exit_criterion": "gate"}, "exit_criterion"),
                         ({"draft": {"layers": 1}}, "draft"),
                         ({"draft": {"solver": "euler"}, "n": 2}, "draft")]:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client.completions.create(model=NAME, prompt="the", max_tokens=5,
                                          extra_body=extra)
        assert e.value.body["param"] == field, extra


BAD = [
    ({"prompt": "the", "max_tokens": 3}, 400, "model"),
    ({"model": NAME, "prompt": "the", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "the", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "the", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "the", "temperature": -0.5}, 400, "temperature"),
    ({"model": NAME, "prompt": "the", "top_p": 0}, 400, "top_p"),
    ({"model": NAME, "prompt": "the", "top_p": 1.5}, 400, "top_p"),
    ({"model": NAME, "prompt": "the", "colour": "red"}, 400, "colour"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
    ({"model": NAME, "prompt": []}, 400, "prompt"),
    ({"model": NAME, "prompt": "é"}, 400, "prompt"),  # outside the character vocabulary
    ({"model": NAME, "prompt": [5000]}, 400, "prompt"),
    ({"model": NAME, "prompt": "a" * 200}, 400, "prompt"),
    ({"model": NAME, "prompt": "a" * 100, "max_tokens": 40}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "the", "stop": [""]}, 400, "stop"),
    ({"model": NAME, "prompt": "the", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": "other", "prompt": "the"}, 404, "model"),
    ({"model": NAME, "prompt": ["the"] * 20, "n": 16}, 400, "prompt"),  # 320 rows > queue
]


@pytest.mark.parametrize("body,status,field", BAD, ids=[b[2] + str(i) for i, b in
                                                          enumerate(BAD)])
def test_bad_input_is_refused_by_name_and_the_server_goes_on(srv, body, status, field):
    r = srv.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"]
    assert srv.client.completions.create(model=NAME, prompt="the", max_tokens=2).choices


def test_malformed_json_oversized_bodies_chat_and_unknown_routes(srv):
    r = srv.post("/v1/completions", data=b"{not json", headers={"Content-Type":
                                                                "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = srv.post("/v1/completions", data=b'{"model": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413 and "max-body-bytes" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="chat template"):
        srv.client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                  "content": "hi"}])
    assert requests.get(srv.url + "/v1/nothing", timeout=10).status_code == 404
    assert [m.id for m in srv.client.models.list()] == [NAME]
    health = requests.get(srv.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["running"] == 0


def test_the_tokenizer_endpoints_lm_eval_reads(srv):
    info = requests.get(srv.url + "/tokenizer_info", timeout=10).json()
    assert "eos_token" in info and info["model_max_length"] == 128
    ids = srv.post("/tokenize", {"prompt": "the cat", "add_special_tokens": False}).json()
    assert ids["tokens"] == srv.tok.encode("the cat")
    assert srv.post("/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == "the cat"


def test_a_full_queue_is_429_and_a_client_that_leaves_is_freed(run_dir):
    s = Running(run_dir, max_batch=1, max_queue=1)
    gate = threading.Event()
    turn = s.engine.turn

    def held():
        if s.engine.running:  # once the first request runs, wait until the test says go
            gate.wait(30)
        turn()
    s.engine.turn = held
    try:
        body = {"model": NAME, "prompt": "the", "max_tokens": 60, "stream": True}
        first = requests.post(s.url + "/v1/completions", json=body, stream=True, timeout=60)
        for _ in range(100):  # the first is taken from the queue (admitted at that turn)
            if not s.engine.waiting:
                break
            time.sleep(0.02)
        second = ThreadPoolExecutor(1).submit(s.post, "/v1/completions", dict(body, stream=False,
                                                                              max_tokens=2))
        for _ in range(100):
            if s.engine.waiting:
                break
            time.sleep(0.02)
        r = s.post("/v1/completions", dict(body, stream=False))
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        gate.set()
        lines = first.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        first.close()  # the client goes away mid-stream
        assert second.result(60).status_code == 200
        for _ in range(200):
            if not s.engine.running and not s.engine.groups:
                break
            time.sleep(0.05)
        assert not s.engine.running and not s.engine.groups
    finally:
        gate.set()
        s.stop()


def test_a_servers_default_exit_leaves_drafted_requests_at_full_depth(run_dir):
    s = Running(run_dir, exit_rule=("state", 1e9))  # every token exits after one step
    try:
        plain = s.client.completions.create(model=NAME, prompt="the", max_tokens=8,
                                            temperature=0)
        assert plain.usage.field_evaluations_per_token < 8  # the server's exit applies
        drafted = s.client.completions.create(
            model=NAME, prompt="the", max_tokens=8, temperature=0,
            extra_body={"draft": {"solver": "euler", "steps": 1}})
        assert drafted.choices[0].finish_reason == "length"
        assert len(drafted.choices[0].text) == 8
    finally:
        s.stop()


# ------------------------------------------------------------- the command, as users run it

def _start(run, *extra):
    p = subprocess.Popen([sys.executable, "-m", "continuumlm", "serve", "--checkpoint",
                          str(run), "--port", "0", "--threads", "1", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "serving" in line, line + p.stderr.read()
    return p, line.split("http://")[1].split("/v1")[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_stream_drains_it_and_exits_0(run_dir, sig):
    p, where = _start(run_dir)
    try:
        r = requests.post(f"http://{where}/v1/completions", stream=True, timeout=60, json={
            "model": NAME, "prompt": "the", "max_tokens": 120, "stream": True})
        lines = (line for line in r.iter_lines() if line)
        first = next(lines)
        p.send_signal(sig)
        rest = list(lines)
        assert rest[-1] == b"data: [DONE]"
        last = json.loads(rest[-2][len(b"data: "):])
        assert last["choices"][0]["finish_reason"] == "length"
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in [first, *rest[:-1]])
        assert len(text) == 120
        assert p.wait(60) == 0
        # a float32 model on the CPU: decoded on torch's own kernels (--onednn auto)
        assert "decoding with torch's own CPU kernels (oneDNN off)" in p.stderr.read()
        with pytest.raises(requests.ConnectionError):  # it no longer listens
            requests.get(f"http://{where}/health", timeout=5)
    finally:
        p.kill()


def test_a_missing_extra_or_a_bad_flag_exits_2(run_dir, monkeypatch):
    import continuumlm.serve.server as S

    monkeypatch.setattr(S, "missing_extra", lambda: "continuumlm serve needs FastAPI and "
                        "uvicorn; install them with: pip install 'continuumlm[serve]'")
    r = run_cli("serve", "--checkpoint", run_dir)
    assert r.returncode == 2 and "continuumlm[serve]" in r.stderr
    monkeypatch.undo()
    r = run_cli("serve", "--checkpoint", run_dir, "--ode-solver", "dopri5")
    assert r.returncode == 2 and "fixed-grid" in r.stderr


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_lm_eval_hf(run_dir, tmp_path):
    """Stock ``lm_eval --model local-completions`` against the server (its tokenizer read
    through /tokenize) gives each choice the log-likelihood stock ``lm_eval --model hf``
    gives the exported model in process (echo + logprobs, as OpenAI's legacy API)."""
    pytest.importorskip("lm_eval")
    lines = ["the cat sat on a mat", "alpha beta gamma", "a mat on the cat", "delta the cat",
             "gamma sat on alpha", "beta beta the mat"]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"prompt": x[:6], "choices": [x[6:], " the mat", " a"]})
                            + "\n" for x in lines))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    from test_hf_flows import _STOCK_TASKS  # its multiple-choice task, on these documents

    choice = next(t for t in _STOCK_TASKS.split("---\n") if "stock_choice" in t)
    (tasks / "serve_choice.yaml").write_text(choice.format(data=data).replace(
        "stock_choice", "serve_choice"))
    r = run_cli("export", "--format", "hf", "--checkpoint", run_dir, "--out", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    exe = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    env = {**os.environ, "OPENAI_API_KEY": "none", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    common = ["--tasks", "serve_choice", "--include_path", str(tasks), "--log_samples"]
    p, where = _start(run_dir)
    try:
        r = subprocess.run([exe, "--model", "local-completions", "--model_args",
                            f"base_url=http://{where}/v1/completions,model={NAME},"
                            f"tokenizer_backend=remote", *common, "--output_path",
                            str(tmp_path / "api")], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    r = subprocess.run([exe, "--model", "hf", "--model_args",
                        f"pretrained={tmp_path / 'hf'},trust_remote_code=True", "--device",
                        "cpu", *common, "--output_path", str(tmp_path / "local")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _loglikelihoods(tmp_path / "api"), _loglikelihoods(tmp_path / "local")
    assert got.keys() == want.keys() and len(got) == 3 * len(lines)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-4), k


def _loglikelihoods(folder) -> dict:
    out = {}
    for f in folder.rglob("samples_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            for i, resp in enumerate(s["resps"]):
                out[(s["doc_id"], i)] = float(resp[0][0])
    return out


def test_a_pipelined_draft_is_served_and_its_drafter_kept(run_dir):
    """draft.pipeline: the drafts made ahead by a drafting process of their own; greedy, the
    text of plain decoding; the engine keeps that process for the next request and ends it
    with the engine; what cannot be pipelined is refused with the reason (400)."""
    s = Running(run_dir)
    try:
        plain = s.client.completions.create(model=NAME, prompt="the", max_tokens=24,
                                            temperature=0)
        spec = {"solver": "euler", "steps": 1, "tokens": 4, "pipeline": True}
        texts, kept = [], []
        for _ in range(2):
            r = s.client.completions.create(model=NAME, prompt="the", max_tokens=24,
                                            temperature=0, extra_body={"draft": spec})
            texts.append(r.choices[0].text)
            for _ in range(200):  # the stream ends at the engine's turn after its last token
                if not s.engine.solos and s.engine._drafting._pool._idle:
                    break
                time.sleep(0.05)
            kept.append(list(s.engine._drafting._pool._idle.values()))
        assert texts == [plain.choices[0].text] * 2
        assert len(kept[0]) == 1 and kept[1] == kept[0]  # one process, used by both
        r = s.post("/v1/completions", {"model": NAME, "prompt": "the", "max_tokens": 4,
                                       "draft": dict(spec, tokens="auto")})
        assert r.status_code == 400
        assert "'draft.pipeline': a round takes a fixed number of drafts" in \
            r.json()["error"]["message"]
        proc = kept[0][0].proc
    finally:
        s.stop()
    proc.join(10)
    assert not proc.is_alive()  # ended with the engine


def test_a_pipelined_stream_cut_off_by_its_client_hands_back_its_drafter(run_dir):
    """A client that goes away mid-stream: the engine ends the drafted stream, so the
    drafting process is kept (idle, for the next request) and the thread count held for the
    stream is let go."""
    from continuumlm.decoding import pipeline

    s = Running(run_dir)
    try:
        body = {"model": NAME, "prompt": "the", "max_tokens": 100, "stream": True,
                "temperature": 0,
                "draft": {"solver": "euler", "steps": 1, "tokens": 4, "pipeline": True}}
        r = s.post("/v1/completions", body, stream=True)
        # the first token comes from the prompt's pass, before the drafting process is
        # taken: the third is after it
        lines = (line for line in r.iter_lines() if line)
        assert all(next(lines).startswith(b"data: ") for _ in range(3))
        r.close()
        for _ in range(200):
            if not s.engine.solos and s.engine._drafting._pool._idle:
                break
            time.sleep(0.05)
        assert not s.engine.solos
        assert len(s.engine._drafting._pool._idle) == 1  # handed back clean, kept
        assert pipeline._threads[0] == 0  # no pipelined stream holds the thread count
    finally:
        s.stop()
