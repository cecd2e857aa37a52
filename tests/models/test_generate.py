"""The command line as a user meets it (models.generate): every mistake is one `error:` line with
exit code 2, nothing allocated first; the memory estimate; the time it reports per token
(tiny preset, 8 host CPU devices from conftest.py)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import sifar_jax
from models import LOOPS, Decoder, LlamaConfig, generate, make_mesh, random_params
from models.core.tp import ALLREDUCE_KINDS
from models.decoder import compile_cache, footprint
from models.registry import preset, presets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def sifar_clean(monkeypatch):
    """The CLI calls sifar_jax.init (sifar is its default): start and end with no communicator.
    And it turns the persistent compilation cache on: never in the suite, unless a test says."""
    monkeypatch.setenv(compile_cache.ENV_OFF, "1")
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


def _error(capsys, argv) -> str:
    """Run the CLI in this process; it must fail with one `error:` line and exit code 2."""
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,match", [
    (["--prompt-ids", "5", "99999", "7"], "token id 99999 is outside the vocabulary [0, 256)"),
    (["--prompt-ids", "5", "-3", "7"], "token id -3 is outside"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--tokens", "-5"], "--tokens must be >= 1"),
    (["--tp", "0"], "--tp must be >= 1"),
    (["--tp", "3"], "tp=3 must divide num_kv_heads=4"),
    (["--dtype", "int8"], "--dtype must be a float dtype"),
    (["--dtype", "nonsense"], "is not a dtype"),
    (["--checkpoint", "/no/such/dir"], "no such directory"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--preset", "nope"], "unknown --preset 'nope'"),
    (["--eos", "3", "256"], "stop id 256 (--eos or the checkpoint's) is outside"),
    (["--eos", "3", "--ignore-eos"], "contradict"),
    (["--prompt-ids", "1", "--prompt", "x"], "not both"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--allreduce", "psum", "--fused"], "--fused needs --allreduce sifar"),
    (["--allreduce", "psum", "--algorithm", "oneshot"], "is sifar's"),
    (["--max-seq-len", "16", "--tokens", "32"], "cannot hold the prompt"),
])
def test_each_user_error_is_one_line_and_exit_code_2(capsys, argv, match):
    assert match in _error(capsys, argv)


def test_checkpoint_dir_without_config(capsys, tmp_path):
    assert "no config.json" in _error(capsys, ["--checkpoint", str(tmp_path)])


def test_an_unknown_algorithm_is_an_argparse_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(["--algorithm", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(a in err for a in sifar_jax.ALGORITHMS)


def test_a_model_too_large_for_the_memory_is_refused_before_allocating(capsys, monkeypatch):
    monkeypatch.setattr(footprint, "_host_available", lambda: 1 << 20)  # 1 MiB of "RAM"
    allocated = []
    monkeypatch.setattr(type(presets()["tiny"]), "random_params",
                        lambda *a, **k: allocated.append(1))
    line = _error(capsys, ["--tp", "2"])
    assert "the model needs about" in line and "GiB per device" in line and not allocated


def test_host_devices_share_one_memory_so_8b_at_tp2_is_refused_on_23_gib(capsys, monkeypatch):
    """XLA:CPU's host devices share the host's memory, and XLA:CPU keeps float32 copies of the
    bfloat16 matmul weights: llama3_8b at --tp 2 needs ~48 GiB of a 23 GiB host (the check
    before this one compared 9.93 GiB per device with 23/2 available per device, passed it,
    and the kernel killed the process), so it is refused up front with one error line."""
    monkeypatch.setattr(footprint, "_host_available", lambda: 23 << 30)
    family, c = presets()["llama3_8b"], preset("llama3_8b")
    est = footprint.estimate(family, c, 2, 1, 64, 8)
    assert est.total < 0.9 * (23 << 30) / 2  # what the per-device comparison let through
    assert est.host_total(2) > 40 << 30
    with pytest.raises(MemoryError, match="of host memory"):
        footprint.check_fits(est, jax.devices("cpu")[:2])
    allocated = []
    monkeypatch.setattr(type(family), "random_params", lambda *a, **k: allocated.append(1))
    line = _error(capsys, ["--preset", "llama3_8b", "--tp", "2"])
    assert "the model needs about" in line and "host memory" in line and not allocated
    # a float32 model has no float32 copies; the tiny one fits
    assert footprint.estimate(family, c.replace(dtype="float32"), 2, 1, 64).cpu_matmul_copies == 0
    footprint.check_fits(footprint.estimate(presets()["tiny"], preset("tiny"), 2, 1, 64),
                         jax.devices("cpu")[:2])


def test_the_estimate_counts_split_and_replicated_weights_and_the_cache():
    family, c = presets()["llama3_8b"], preset("llama3_8b")
    one, two = (footprint.estimate(family, c, tp, 1, 4096) for tp in (1, 2))
    params = 8_030_261_248  # Llama-3.1-8B
    assert one.weights == 2 * params
    # replicated, whole on every device: the embedding and the norms
    whole = (c.vocab_size + 2 * c.num_layers + 1) * c.hidden_size * 2
    assert two.weights == (2 * params - whole) // 2 + whole
    kv = 2 * c.num_layers * 4096 * c.num_kv_heads * c.head_dim * 2  # k and v, bf16
    assert (one.kv_cache, two.kv_cache) == (kv, kv // 2)
    with pytest.raises(MemoryError, match="GiB per device"):
        footprint.check_fits(footprint.Footprint(1 << 50, 0, 0), jax.devices()[:1])
    footprint.check_fits(footprint.Footprint(1 << 20, 0, 0), jax.devices()[:1])


def test_the_decoder_refuses_ids_outside_the_vocabulary():
    config = LlamaConfig.tiny()
    mesh = make_mesh(1)
    dec = Decoder(config, mesh, random_params(config, mesh, seed=1))
    for bad in ([5, 256, 7], [5, -1, 7]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            dec.generate(np.array(bad), 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.seek(3, [300])
    with pytest.raises(ValueError, match="integers"):
        dec.generate(np.array([1.5, 2.0]), 4)


def test_choices_are_the_models():
    assert set(generate.ALLREDUCE_CHOICES) == set(ALLREDUCE_KINDS)
    assert set(generate.LOOP_CHOICES) == set(LOOPS)


def test_help_shows_defaults_choices_and_what_identity_means():
    """In a subprocess, as a user runs it: --help exits 0 and shows each default and choice."""
    out = subprocess.run([sys.executable, "-m", "models.generate", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "(default: sifar)" in flat and "(default: stream)" in flat
    assert "{sifar,psum,sifar_buffers,identity}" in flat
    assert "{auto," + ",".join(sifar_jax.ALGORITHMS) + "}" in flat
    assert generate.IDENTITY_NOTE in flat


def test_a_user_error_in_a_real_process_prints_no_traceback():
    r = subprocess.run([sys.executable, "-m", "models.generate", "--tp", "3"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: --tp 3") and r.stderr.count("\n") == 1, r.stderr


def test_quantize_fp8_decodes_with_fp8_weights(capsys, monkeypatch):
    """--quantize fp8: the random weights' projections quantized after they are made; the memory
    check is asked about the FP8 model."""
    from models.decoder import footprint

    asked = []
    real = footprint.estimate
    monkeypatch.setattr(footprint, "estimate", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    assert generate.main(["--tp", "2", "--tokens", "4", "--quantize", "fp8", "--allreduce",
                          "psum", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "weights=fp8" in out.splitlines()[0]
    assert len([ln for ln in out.splitlines() if ln.startswith("tokens:")][0].split()) == 1 + 4
    assert asked and asked[0][-1] == "fp8"


def test_step_persistent_runs_the_cpu_reference_on_host_devices(capsys, monkeypatch):
    """--step persistent on host devices, TP=2, FP8: the op's CPU reference runs each step
    across the devices (the device line says so), with the tokens of --step xla; the default
    step ("auto") runs the XLA step there and says why."""
    import sifar_jax

    calls, real = [], sifar_jax.llama_step
    monkeypatch.setattr(sifar_jax, "llama_step", lambda *a, **k: calls.append(k) or real(*a, **k))
    argv = ["--preset", "llama_step_tiny", "--tp", "2", "--quantize", "fp8", "--tokens", "6",
            "--no-warmup"]
    out = {}
    for step in ("persistent", "xla", None):
        assert generate.main(argv + (["--step", step] if step else [])) == 0
        lines = capsys.readouterr().out.splitlines()
        out[step] = ([ln for ln in lines if ln.startswith("device:")][0],
                     [ln for ln in lines if ln.startswith("tokens:")][0])
    assert "step=persistent (sifar_jax.llama_step's CPU reference" in out["persistent"][0]
    assert "TP=2 one rank per device, sifar all-reduce inside" in out["persistent"][0]
    assert calls and all(k["axis_name"] == "tp" for k in calls)
    assert out["xla"][0].endswith("step=xla")
    assert "step=xla (auto: the persistent step is a CUDA kernel" in out[None][0]
    assert out["persistent"][1] == out["xla"][1] == out[None][1]
    assert len(out["xla"][1].split()) == 1 + 6


def test_step_persistent_where_it_cannot_serve_is_one_error_line(capsys):
    """--step persistent on a model the step does not serve (the tiny preset: float32,
    head_dim 16): one error line saying why, no silent fallback."""
    line = _error(capsys, ["--tokens", "4", "--quantize", "fp8", "--step", "persistent",
                           "--no-warmup"])
    assert "step='persistent' cannot run this decoder: dtype=float32" in line, line


@pytest.mark.parametrize("loop", LOOPS)
def test_every_loop_prints_its_tokens_once_and_a_true_time_per_token(capsys, loop):
    assert generate.main(["--tp", "2", "--tokens", "12", "--loop", loop, "--seed", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "allreduce=sifar/auto" in lines[0]  # sifar by default where sifar_jax works
    streamed = [ln for ln in lines if ln.startswith("tokens:")]
    assert len(streamed) == 1 and len(streamed[0].split()) == 1 + 12
    ttft = [ln for ln in lines if ln.startswith("time to first token:")]
    tpot = [ln for ln in lines if ln.startswith("time per output token:")]
    assert len(ttft) == len(tpot) == 1 and "over 11 tokens" in tpot[0]
    assert "prefill of 8 tokens, padded to 16, all-reduce sifar;" in ttft[0]
    # a true time per token on these 2 cores is far above the 0.015 ms of timing the printing
    assert float(tpot[0].split()[4]) > 0.05, tpot[0]


def test_the_time_per_output_token_does_not_depend_on_other_requests(capsys, monkeypatch):
    """The time per output token is this request's own (its first token to its last): it once
    subtracted the median time to first token of other requests, and went negative on CI's busy
    cores when those were slower than this whole request. Here they take 10 s."""
    monkeypatch.setattr(generate, "_time_to_first_token", lambda *args: 10.0)
    assert generate.main(["--tp", "2", "--tokens", "12", "--loop", "pipelined", "--seed", "3"]) == 0
    tpot = [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("time per output token:")]
    assert len(tpot) == 1 and 0.05 < float(tpot[0].split()[4]) < 1000, tpot[0]


# ---- the persistent compilation cache ---------------------------------------------------------------

def test_the_cache_directory_and_the_switches(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_OFF)
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == str(tmp_path / "sifar-jax" / "jax-cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" / "sifar-jax" / "jax-cache")
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    for off in ("1", "true", "yes"):
        monkeypatch.setenv(compile_cache.ENV_OFF, off)
        assert compile_cache.enable(str(tmp_path / "x")) is None
    monkeypatch.setenv(compile_cache.ENV_OFF, "0")
    assert compile_cache.enable(str(tmp_path / "x"), off=True) is None
    assert not (tmp_path / "x").exists() and jax.config.jax_compilation_cache_dir is None


def test_a_second_compile_reads_the_cache(monkeypatch, tmp_path):
    """In this process, with the in-memory caches cleared in between (as a new process has
    them): the first compile writes the directory, the second reads it."""
    monkeypatch.delenv(compile_cache.ENV_OFF)
    path = str(tmp_path / "cache")
    f = lambda x: jax.numpy.sin(x) * 3.0 + 1.0  # noqa: E731
    try:
        assert compile_cache.enable(path) == path
        with compile_cache.CacheUse() as first:
            jax.jit(f).lower(np.ones(7, np.float32)).compile()
        assert (first.hits, first.misses) == (0, 1) and os.listdir(path)
        jax.clear_caches()
        with compile_cache.CacheUse() as second:
            jax.jit(f).lower(np.ones(7, np.float32)).compile()
        assert (second.hits, second.misses) == (1, 0)
        assert second.describe().startswith("warm start")
    finally:
        compile_cache.disable()
    assert jax.config.jax_compilation_cache_dir is None


def test_the_cli_starts_warm_the_second_time(tmp_path):
    """Two processes with the cache in a temporary XDG_CACHE_HOME: the first compiles and
    writes it (cold), the second reads every executable (warm)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    env.pop(compile_cache.ENV_OFF, None)
    env.pop(compile_cache.ENV_DIR, None)
    cmd = [sys.executable, "-m", "models.generate", "--tp", "2", "--tokens", "4",
           "--allreduce", "psum"]
    outs = [subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    where = tmp_path / "sifar-jax" / "jax-cache"
    assert f"compilation cache: {where}" in outs[0] and os.listdir(where)
    assert "cold start: 0 read from the compilation cache" in outs[0]
    assert ", warm start: " in outs[1] and " 0 compiled" in outs[1], outs[1]
    off = subprocess.run(cmd + ["--no-compile-cache"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "compilation cache: off" in off


# ---- text in, text out --------------------------------------------------------------------------------

TEXTS = ["hello world", "the café is naïve", "日本語のテキスト", "smile 😀 please",
         "hello hello world", "the user asks and the model answers"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_level_bpe(path, vocab_size=300):
    """A byte-level BPE (as Llama 3's) trained on a few words, with few enough merges that an
    emoji or a CJK character is split over several tokens. Saved as path/tokenizer.json."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint (random weights, a 300-token vocabulary) with a tokenizer, a chat
    template and two stop ids, as a Hugging Face checkpoint directory."""
    import json

    from models import LLAMA

    path = tmp_path_factory.mktemp("text-llama")
    _byte_level_bpe(path)
    config = LlamaConfig.tiny(vocab_size=300)
    mesh = make_mesh(2)
    LLAMA.save_hf_checkpoint(random_params(config, mesh, seed=5), config, str(path))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return path


def test_checkpoint_with_quantize_fp8_is_the_loaders_quantize_at_load(capsys, monkeypatch,
                                                                       text_checkpoint):
    """--checkpoint with --quantize fp8 quantizes shard by shard as it loads
    (load_hf_checkpoint(quantize="fp8"), never the whole bf16 model first), with the tokens of
    that route through the API."""
    from models import LLAMA
    from models.weights import fp8_load
    from models import Decoder

    asked = []
    real = fp8_load.load_fp8
    monkeypatch.setattr(fp8_load, "load_fp8", lambda *a: asked.append(a[-1]) or real(*a))

    argv = ["--checkpoint", str(text_checkpoint), "--tp", "2", "--allreduce", "psum",
            "--tokens", "8", "--prompt-ids", "5", "6", "7", "--no-warmup", "--show-ids",
            "--ignore-eos"]
    assert generate.main(argv + ["--quantize", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights=fp8" in out.splitlines()[0], out
    assert asked == ["fp8"]
    cli = [ln for ln in out.splitlines() if ln.startswith("tokens:")][0].split()[1:]
    config, params = LLAMA.load_hf_checkpoint(str(text_checkpoint), make_mesh(2),
                                              quantize="fp8")
    assert config.quantization == "compressed-tensors:channel"
    api = [int(t) for t in Decoder(config, make_mesh(2), params).generate(
        np.array([[5, 6, 7]]), 8)[0]]
    assert [int(t) for t in cli] == api, (cli, api)


def test_text_stream_never_cuts_a_character(text_checkpoint):
    """Tokens pushed one at a time: the pieces joined are the whole text, none holds a partial
    character, and an emoji split over several tokens arrives in one piece."""
    from models.generate.tokenizer import TextTokenizer

    tok = TextTokenizer(str(text_checkpoint))
    text = "smile 😀 café 日本語 please"
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids) == text  # BOS added, then skipped when decoding
    singles = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in singles), "the fixture splits no character over tokens"
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces), pieces
    assert any("😀" in p for p in pieces)
    # with the prompt's last ids as context, the answer's text is the difference of the decodes
    prompt, answer = ids[:5], ids[5:]
    assert tok.stream(prompt).feed(answer) == tok.decode(ids)[len(tok.decode(prompt)):]


def test_chat_template_stop_ids_and_errors(text_checkpoint, tmp_path):
    import json
    import shutil

    from models.generate.tokenizer import TextTokenizer, checkpoint_eos_ids

    tok = TextTokenizer(str(text_checkpoint))
    assert tok.render_chat("hi there") == "<s><|user|>hi there</s><|assistant|>"
    ids = tok.encode("hi there", chat=True)
    assert ids.count(0) == 1 and ids[-1] == tok.tokenizer.token_to_id("<|assistant|>")
    assert tok.eos_ids == checkpoint_eos_ids(str(text_checkpoint)) == [1, 3]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(text_checkpoint / "tokenizer.json", bare)
    (bare / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    plain = TextTokenizer(str(bare))
    assert plain.eos_ids == [2] and plain.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        plain.encode("hi", chat=True)


def _between_rules(out: str) -> str:
    return out.split(generate.TEXT_RULE + "\n")[1]


def test_text_in_text_out_round_trip(capsys, text_checkpoint):
    """--prompt TEXT: the CLI's streamed text is the decode of the tokens the Decoder generates
    for the encoded prompt; --chat encodes it through the template; the checkpoint's stop ids
    end it (generation_config.json's list); --show-ids prints the ids."""
    import json

    from models.generate.tokenizer import TextTokenizer

    tok = TextTokenizer(str(text_checkpoint))
    config = LlamaConfig.tiny(vocab_size=300)
    mesh = make_mesh(2)
    dec = Decoder(config, mesh, random_params(config, mesh, seed=5))
    base = ["--checkpoint", str(text_checkpoint), "--tp", "2", "--allreduce", "psum",
            "--tokens", "16"]
    for chat in (False, True):
        ids = tok.encode("hello world", chat=chat)
        want = dec.generate(np.array(ids), 16)[0]
        assert generate.main(base + ["--prompt", "hello world", "--ignore-eos"]
                             + (["--chat"] if chat else [])) == 0
        out = capsys.readouterr().out
        assert f"prompt ({len(ids)} tokens): " in out
        assert _between_rules(out) == tok.decode(want) + "\n", out
    # the checkpoint's stop ids: the answer ends at the first of them it produces
    stop = int(want[5])
    (text_checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [299, stop]}))
    try:
        assert generate.main(base + ["--prompt", "hello world", "--chat", "--show-ids"]) == 0
    finally:
        (text_checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    out = capsys.readouterr().out
    first = int(np.flatnonzero(want == stop)[0])
    assert f"stop ids: 299 {stop}\n" in out
    assert f"tokens: {' '.join(map(str, want[:first + 1]))} \n" in out, out


def test_text_prompts_need_a_tokenizer(capsys, tmp_path):
    assert "needs --checkpoint" in _error(capsys, ["--prompt", "hello"])
    assert "--chat applies" in _error(capsys, ["--chat"])
    import json

    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.tiny().to_hf_config()))
    line = _error(capsys, ["--checkpoint", str(tmp_path), "--prompt", "hello"])
    assert "has no tokenizer.json" in line
