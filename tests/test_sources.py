"""Model sources: hub ids through a prepared HF cache (offline), sharded safetensors with
their index, generation_config.json (EOS ids and default sampling parameters), chat
templates and BOS. Tiny random Llama models with the embedded model's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from chunkserve.config import EngineConfig
from chunkserve.engine.engine import Engine
from chunkserve.model import hub
from chunkserve.model.loader import resolve_model
from chunkserve.model.source import open_gguf, weights_only_reader
from chunkserve.scheduling.sampling_params import SamplingParams

REPO_ID = "tiny-org/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40
PROMPT = "The capital of France is"


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.5,  # greedy tokens that differ between seeds
    )


def write_tiny(out: Path, tokenizer_dir: Path, seed: int, **save_kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True, **save_kwargs)
    (out / "generation_config.json").unlink(missing_ok=True)  # each test writes its own
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "a": write_tiny(root / "a", hf_dir, seed=0),
        "b": write_tiny(root / "b", hf_dir, seed=1),
        # The model of "a", sharded into several files with model.safetensors.index.json.
        "a_sharded": write_tiny(root / "a_sharded", hf_dir, seed=0, max_shard_size="600KB"),
    }


def snapshot_into(cache: Path, repo_id: str, commit: str, src: Path, refs=("main",)) -> Path:
    """huggingface_hub's cache layout: files in blobs/, the snapshot's names linking to them,
    refs/<branch or tag> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_dirs) -> Path:
    """A cache holding REPO_ID: main = model "a", tag v1 = model "b"."""
    cache = tmp_path_factory.mktemp("hf-cache")
    snapshot_into(cache, REPO_ID, COMMIT_MAIN, tiny_dirs["a"])
    snapshot_into(cache, REPO_ID, COMMIT_V1, tiny_dirs["b"], refs=("v1",))
    return cache


@pytest.fixture
def offline(monkeypatch, hub_cache):
    """HF_HUB_OFFLINE=1 and the prepared cache as HF_HUB_CACHE; every call to
    snapshot_download is recorded (none may go to the network)."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kw):
        calls.append(kw)
        if not kw.get("local_files_only"):
            raise AssertionError("a network call with HF_HUB_OFFLINE=1")
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    return calls


def greedy_tokens(engine: Engine, n: int = 8) -> list[int]:
    engine.add_request(PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    assert out is not None
    return out.token_ids


def make_engine(model: str, **kw) -> Engine:
    return Engine(model=model, dtype="float32", kv_cache_memory=4 << 20, max_model_len=128, **kw)


# ---- hub ids ---------------------------------------------------------------------------------
def test_hub_id_loads_from_the_cache_offline(offline, tiny_dirs) -> None:
    hub_engine = make_engine(REPO_ID)
    assert hub_engine.model_name == REPO_ID  # served as the id, like vLLM
    assert Path(hub_engine.model_path).parent.name == "snapshots" or COMMIT_MAIN in (
        hub_engine.model_path
    )
    local = make_engine(str(tiny_dirs["a"]))
    other = make_engine(str(tiny_dirs["b"]))
    tokens = greedy_tokens(hub_engine)
    assert tokens == greedy_tokens(local)
    assert tokens != greedy_tokens(other)  # the models differ: the test can tell them apart
    assert offline and all(c["local_files_only"] for c in offline)


def test_draft_model_from_the_hub_at_a_revision(offline, tiny_dirs) -> None:
    spec = {"method": "draft_model", "model": REPO_ID, "revision": "v1"}
    engine = make_engine(str(tiny_dirs["a"]), speculative_config=spec)
    assert engine.core.worker._draft_source.path.name == COMMIT_V1
    assert greedy_tokens(engine) == greedy_tokens(make_engine(str(tiny_dirs["a"])))
    with pytest.raises(ValueError, match=r"^speculative_config\.model: model: 'tiny-org.*'v2'"):
        make_engine(str(tiny_dirs["a"]), speculative_config={**spec, "revision": "v2"})


def test_revision_branch_tag_commit_and_wrong_one(offline) -> None:
    main = resolve_model(REPO_ID)
    assert main.path.name == COMMIT_MAIN
    assert resolve_model(REPO_ID, revision="v1").path.name == COMMIT_V1  # a tag
    assert resolve_model(REPO_ID, revision=COMMIT_V1).path.name == COMMIT_V1  # a commit
    with pytest.raises(ValueError, match=r"^model: 'tiny-org/tiny-llama'.*'nope'.*OFFLINE"):
        resolve_model(REPO_ID, revision="nope")


def test_unknown_id_is_a_clear_error_offline(offline) -> None:
    with pytest.raises(
        ValueError,
        match=r"^model: 'nobody/nothing' is neither a local path nor in the HF cache.*"
        r"HF_HUB_OFFLINE is set \(no download tried\)",
    ):
        resolve_model("nobody/nothing")
    assert offline and all(c.get("local_files_only") for c in offline)
    with pytest.raises(ValueError, match=r"^model: 'nobody/nothing' is neither"):
        make_engine("nobody/nothing")


def test_download_dir_and_hf_home(monkeypatch, offline, hub_cache, tmp_path) -> None:
    # HF_HUB_CACHE names an empty cache: only --download-dir finds the model.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="neither a local path"):
        resolve_model(REPO_ID)
    assert resolve_model(REPO_ID, download_dir=str(hub_cache)).path.name == COMMIT_MAIN
    # HF_HOME/hub when HF_HUB_CACHE is unset.
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model(REPO_ID).path.name == COMMIT_MAIN


def test_a_local_path_wins_over_a_hub_id(offline, monkeypatch, tmp_path, tiny_dirs) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dirs["b"], tmp_path / REPO_ID)
    source = resolve_model(REPO_ID)
    assert source.path == Path(REPO_ID) and source.name == "tiny-llama"
    assert not offline  # the cache was not even looked at


def test_download_takes_only_the_files_we_load(monkeypatch, tmp_path, tiny_dirs) -> None:
    """Not offline, not cached: one download, of the model's files only (no *.bin)."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cache = tmp_path / "cache"
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def fake_hub(repo_id, **kw):
        calls.append(kw)
        if not kw.get("local_files_only"):  # "the network": fills the cache
            snapshot_into(Path(kw["cache_dir"]), repo_id, COMMIT_MAIN, tiny_dirs["a"])
        return real(repo_id, **{**kw, "local_files_only": True})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    source = resolve_model(REPO_ID, download_dir=str(cache))
    assert source.path.name == COMMIT_MAIN and source.kind == "hf"
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    patterns = calls[1]["allow_patterns"]
    assert "*.safetensors" in patterns and "config.json" in patterns
    assert not any(p.endswith((".bin", ".pt", ".pth")) or p == "*" for p in patterns)


def test_an_incomplete_cached_snapshot_is_downloaded_again(monkeypatch, tmp_path, tiny_dirs):
    """A cached snapshot lacking a shard its index names (an interrupted download): offline,
    an error saying so; online, the download completes it."""
    import huggingface_hub

    cache = tmp_path / "cache"
    snap = snapshot_into(cache, REPO_ID, COMMIT_MAIN, tiny_dirs["a_sharded"])
    shard = sorted(snap.glob("*.safetensors"))[-1]
    shard.unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"cache's copy of .* lacks config\.json and every"):
        resolve_model(REPO_ID, download_dir=str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls: list[bool] = []
    real = huggingface_hub.snapshot_download

    def fake_hub(repo_id, **kw):
        calls.append(kw.get("local_files_only", False))
        if not kw.get("local_files_only"):  # "the network" brings the shard
            shutil.copy(tiny_dirs["a_sharded"] / shard.name, shard)
        return real(repo_id, **{**kw, "local_files_only": True})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    assert resolve_model(REPO_ID, download_dir=str(cache)).path == snap
    assert calls == [True, False]


def test_unreachable_hub_names_the_id(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    real = huggingface_hub.snapshot_download

    def no_network(repo_id, **kw):
        if kw.get("local_files_only"):
            return real(repo_id, **kw)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(ValueError, match=r"^model: 'nobody/nothing'.*could not be reached"):
        resolve_model("nobody/nothing", download_dir=str(tmp_path))


def test_tokenizer_and_gguf_from_the_hub(offline, hub_cache, gguf_path: Path) -> None:
    assert hub.resolve_tokenizer(REPO_ID) == str(resolve_model(REPO_ID).path)
    # org/name:QUANT names one GGUF file of a repository (vLLM's syntax).
    snap = hub_cache / "models--tiny-org--smol-GGUF" / "snapshots" / COMMIT_MAIN
    if not snap.exists():
        snap.mkdir(parents=True)
        (snap / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(gguf_path)
        (snap / "SmolLM2-135M-Instruct.Q8_0.gguf").symlink_to(gguf_path)
        (snap.parent.parent / "refs").mkdir()
        (snap.parent.parent / "refs" / "main").write_text(COMMIT_MAIN)
    source = resolve_model("tiny-org/smol-GGUF:q4_1")
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ValueError, match=r"exactly one \*Q5_K_M\.gguf"):
        resolve_model("tiny-org/smol-GGUF:Q5_K_M")


# ---- sharded safetensors -----------------------------------------------------------------------
def test_sharded_checkpoint_loads_the_files_its_index_names(tiny_dirs, tmp_path) -> None:
    sharded = tiny_dirs["a_sharded"]
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 2 and (sharded / "model.safetensors.index.json").is_file()
    # A stray file the index does not name (sorted last, a real tensor name, other values)
    # must not be read.
    from safetensors.torch import save_file

    model = tmp_path / "m"
    shutil.copytree(sharded, model)
    save_file({"model.norm.weight": torch.zeros(32)}, str(model / "zz-stray.safetensors"))
    expected = greedy_tokens(make_engine(str(tiny_dirs["a"])))
    assert greedy_tokens(make_engine(str(model))) == expected
    # A shard the index names and lacks: refused before loading, naming it.
    (model / shards[-1]).unlink()
    with pytest.raises(ValueError, match=f"missing in .*: {shards[-1]}"):
        make_engine(str(model))


# ---- generation_config.json --------------------------------------------------------------------
def with_generation_config(src: Path, dst: Path, gen: dict) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


GEN = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
    "do_sample": True,
    "eos_token_id": [0, 2, 7],
}


def checked(engine: Engine, params: SamplingParams | None = None) -> SamplingParams:
    return engine.inputs.process(PROMPT, params).params


@pytest.fixture(scope="module")
def gen_model(tiny_dirs, tmp_path_factory) -> Path:
    return with_generation_config(tiny_dirs["a"], tmp_path_factory.mktemp("gen") / "m", GEN)


@pytest.fixture(scope="module")
def gen_engine(gen_model) -> Engine:
    return make_engine(str(gen_model))


def test_generation_config_defaults_fill_unset_fields_only(gen_engine) -> None:
    p = checked(gen_engine)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.6,
        0.9,
        20,
        0.05,
        1.1,
        5,
    )
    # Set to the engine's default value is set: kept.
    mine = SamplingParams(temperature=1.0, max_tokens=16)
    p = checked(gen_engine, mine)
    assert (p.temperature, p.max_tokens, p.top_p) == (1.0, 16, 0.9)
    assert mine.top_p == 1.0  # the caller's object is untouched
    mine.top_p = 1.0  # set after construction: set too
    assert checked(gen_engine, mine).top_p == 1.0
    # All three EOS lists count: config.json (2), generation_config.json (0, 2, 7),
    # tokenizer_config.json's eos_token (<|im_end|>).
    im_end = gen_engine.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert set(gen_engine.eos_token_ids) == {0, 2, 7, *im_end}
    assert {0, 2, 7} <= set(gen_engine.tokenizer.eos_token_ids)  # the tokenizer's own list


def test_model_eos_ids_count_with_another_tokenizer(gen_model, hf_dir: Path) -> None:
    """--tokenizer elsewhere: the model folder's generation_config.json EOS ids still end
    generation (its tokenizer folder has none of them)."""
    engine = make_engine(str(gen_model), tokenizer=str(hf_dir))
    assert {0, 7} <= set(engine.eos_token_ids)
    assert not {0, 7} & set(engine.tokenizer.eos_token_ids)


def test_generation_config_defaults_in_llm_generate(gen_engine, tiny_dirs) -> None:
    from chunkserve.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)  # the engine of the fixture, as LLM(model=...) builds one
    llm.engine, llm.tokenizer = gen_engine, gen_engine.tokenizer
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 5  # max_new_tokens, not SamplingParams' 16
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16), use_tqdm=False
    )
    assert len(out[0].token_ids) == 16


def test_generation_config_in_the_openai_server(gen_engine) -> None:
    from fastapi.testclient import TestClient

    from chunkserve.engine.async_engine import AsyncEngine
    from chunkserve.entrypoints.openai.api_server import build_app

    seen: list[SamplingParams] = []
    real = gen_engine.inputs.check

    def spy(*a, **kw):
        r = real(*a, **kw)
        seen.append(r.params)
        return r

    gen_engine.inputs.check = spy
    try:
        app = build_app(AsyncEngine(gen_engine), served_model_name="m")
        with TestClient(app) as client:
            body = {"prompt": PROMPT, "ignore_eos": True}
            r = client.post("/v1/completions", json={**body, "temperature": 0.0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            r = client.post("/v1/completions", json={**body, "max_tokens": 16, "top_p": 1.0})
            assert r.json()["usage"]["completion_tokens"] == 16
            r = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
            )
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        del gen_engine.inputs.check
    assert (seen[0].temperature, seen[0].top_p, seen[0].top_k) == (0.0, 0.9, 20)
    assert (seen[1].max_tokens, seen[1].top_p, seen[1].temperature) == (16, 1.0, 0.6)
    assert (seen[2].temperature, seen[2].max_tokens) == (0.6, 5)


def test_override_max_new_tokens_limits_every_request(gen_model, tmp_path) -> None:
    """vLLM's server: max_new_tokens of --override-generation-config (or of a folder's file)
    caps every request, named or not; the model's own file only gives the default."""
    engine = make_engine(
        gen_model, override_generation_config={"max_new_tokens": 4}
    )  # a Path is taken
    assert checked(engine).max_tokens == 4
    assert checked(engine, SamplingParams(max_tokens=16)).max_tokens == 4
    assert checked(engine, SamplingParams(max_tokens=3)).max_tokens == 3
    assert checked(make_engine(str(gen_model)), SamplingParams(max_tokens=16)).max_tokens == 16


def test_generation_config_modes(tiny_dirs, tmp_path) -> None:
    from chunkserve.model.generation import sampling_defaults

    model = with_generation_config(tiny_dirs["a"], tmp_path / "m", {**GEN, "top_k": 50})
    source = resolve_model(str(model))

    def defaults(**kw):
        return sampling_defaults(EngineConfig(model=str(model), **kw), source)

    # top_k 50 is transformers' default: vLLM drops it (it reads the file's difference).
    assert defaults() == {
        "temperature": 0.6,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 5,
    }
    assert defaults(generation_config="vllm") == {}
    assert defaults(generation_config="vllm", override_generation_config='{"top_k": 3}') == {
        "top_k": 3
    }
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.2}')
    assert defaults(generation_config=str(folder)) == {"temperature": 0.2}
    from chunkserve.model.generation import max_tokens_cap

    (folder / "generation_config.json").write_text('{"max_new_tokens": 7}')
    folder_config = EngineConfig(model=str(model), generation_config=str(folder))
    assert max_tokens_cap(folder_config, defaults(generation_config=str(folder))) == 7
    assert max_tokens_cap(EngineConfig(model=str(model)), defaults()) is None
    merged = defaults(override_generation_config={"temperature": 0.3, "max_new_tokens": 9})
    assert (merged["temperature"], merged["max_tokens"], merged["top_p"]) == (0.3, 9, 0.9)
    with pytest.raises(ValueError, match="^generation_config: '/nowhere' is neither"):
        defaults(generation_config="/nowhere")
    with pytest.raises(ValueError, match=r"^override_generation_config\.top_p: top_p: must be"):
        defaults(override_generation_config={"top_p": 2.0})
    with pytest.raises(ValueError, match=r"^override_generation_config\.do_sample: unknown key"):
        EngineConfig(override_generation_config={"do_sample": True})
    (model / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match=r"^generation_config\.temperature: temperature"):
        defaults()


# ---- chat templates and BOS -------------------------------------------------------------------
WITH_BOS = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WITHOUT_BOS = WITH_BOS.removeprefix("{{ bos_token }}")


@pytest.mark.parametrize("template", [WITH_BOS, WITHOUT_BOS], ids=["adds-bos", "no-bos"])
def test_chat_prompt_has_the_templates_bos_only(hf_dir: Path, tmp_path, template) -> None:
    """A tokenizer that adds BOS to every encode: the chat prompt has the BOS the template
    writes (one, or none), as transformers' apply_chat_template(tokenize=True) gives."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    from chunkserve.engine.tokenizer import Tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    tk = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    ours = Tokenizer.from_hf_dir(folder)
    assert ours.encode("hi")[0] == 0  # the add-BOS rule is on
    messages = [{"role": "user", "content": "Hello there"}]
    ids = ours.encode_chat(messages)
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ids == list(theirs)
    assert ids.count(0) == (1 if template is WITH_BOS else 0)


def test_chat_without_a_template_is_a_400_naming_it(tiny_dirs, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from chunkserve.engine.async_engine import AsyncEngine
    from chunkserve.entrypoints.openai.api_server import build_app

    model = tmp_path / "m"
    shutil.copytree(tiny_dirs["b"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    assert cfg.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = make_engine(str(model))
    app = build_app(AsyncEngine(engine), served_model_name="m")
    with TestClient(app) as client:
        r = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 400, r.text
        assert "no chat template" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 200


def test_no_cost_profile_is_written_into_the_hub_cache(tmp_path) -> None:
    """huggingface_hub owns its snapshot folders: a hub model's cost profile goes to
    ~/.cache/chunkserve/profiles, a local model's beside it."""
    from chunkserve.scheduling.costmodel import default_profile_path

    snap = tmp_path / "models--org--name" / "snapshots" / COMMIT_MAIN
    (snap / "sub").mkdir(parents=True)
    for model in (snap, snap / "m.gguf"):
        path = default_profile_path(str(model), "cpu", "float32", 2)
        assert path.parent == Path.home() / ".cache" / "chunkserve" / "profiles"
    local = default_profile_path(str(tmp_path / "m.gguf"), "cpu", "float32", 2)
    assert local.parent == tmp_path


def test_an_engine_cores_reader_drops_the_vocabulary_not_the_shared_one(gguf_path) -> None:
    """``weights_only_reader`` (engine core processes): the tokenizer's arrays go (Gemma 3's
    vocabulary held ~300 MiB through the weights' load), the ids, config keys and tensors
    stay, and the shared reader is parsed again, whole, for anyone who asks later."""
    reader = open_gguf(gguf_path)
    num_tensors, num_tokens = len(reader.tensors), len(reader.fields["tokenizer.ggml.tokens"].data)
    stripped = weights_only_reader(reader)
    assert "tokenizer.ggml.tokens" not in stripped.fields
    assert "tokenizer.ggml.merges" not in stripped.fields
    assert "tokenizer.ggml.eos_token_id" in stripped.fields
    assert "llama.block_count" in stripped.fields
    assert len(stripped.tensors) == num_tensors
    again = open_gguf(gguf_path)
    assert again is not stripped
    assert len(again.fields["tokenizer.ggml.tokens"].data) == num_tokens
