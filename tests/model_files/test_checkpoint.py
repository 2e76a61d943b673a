"""Checkpoints of either kind, resolved once: a GGUF file gives the engine what a Hugging
Face directory gives it, and `LLM` on a small synthetic GGUF equals transformers on the same
file (tied and untied output, ``add_bos_token`` on and off, qwen2's attention biases)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.model_loader.weights import iter_checkpoint_weights
from model_files.checkpoint import Checkpoint
from model_files.gguf_metadata import GGUFError
from tests.support.gguf_files import CONTEXT, VOCAB, hf_tensors, write_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_NEW_TOKENS = 12
TEXTS = ["the cat sat on the mat", "a", "in the heat there are seats at the theatre " * 3]


def test_a_gguf_file_resolves_to_config_tokenizer_and_weights(tmp_path: Path) -> None:
    original = hf_tensors(tied=True)
    checkpoint = Checkpoint(write_gguf(tmp_path / "m.gguf", original, tokenizer_pre="smollm"))
    config = checkpoint.check()
    assert (config.architecture, config.vocab_size, config.max_model_len) == (
        "LlamaForCausalLM",
        VOCAB,
        CONTEXT,
    )
    assert checkpoint.tokenizer() is checkpoint.tokenizer()  # built once
    assert checkpoint.tokenizer().eos_token_ids == {2}
    weights = dict(iter_checkpoint_weights(checkpoint, torch.float32, show_progress=True))
    assert set(weights) == set(original)
    norm = "model.norm.weight"
    assert torch.equal(weights[norm], torch.from_numpy(original[norm]))


def test_a_directory_resolves_as_before(demo_checkpoint: Callable[..., Path]) -> None:
    path = demo_checkpoint(size="tiny")
    checkpoint = Checkpoint(path)
    assert not checkpoint.is_gguf
    assert checkpoint.check().architecture == "LlamaForCausalLM"
    assert "model.norm.weight" in dict(iter_checkpoint_weights(checkpoint, torch.float32))


def test_what_is_not_a_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no GGUF file at .*missing\.gguf"):
        Checkpoint(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match=r"no config\.json found at .*Hugging Face"):
        Checkpoint(tmp_path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(GGUFError, match=r"junk\.gguf is not a readable GGUF file"):
        Checkpoint(tmp_path / "junk.gguf").check()


def test_the_fingerprint_names_the_file_as_it_is_now(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "a.gguf", hf_tensors(seed=0))
    second = shutil.copy(first, tmp_path / "b.gguf")
    before = Checkpoint(first).fingerprint()
    assert before == Checkpoint(first).fingerprint()
    assert before != Checkpoint(second).fingerprint()
    write_gguf(first, hf_tensors(seed=1))
    os.utime(first, ns=(1, 1))  # a rewrite within the clock's resolution still differs
    assert Checkpoint(first).fingerprint() != before


def test_a_gguf_plan_is_read_without_torch(tmp_path: Path) -> None:
    """The gateway never imports torch: ``tollway serve`` reads a GGUF model's context
    window and checks it (config, tokenizer, tensor types) with torch unimportable."""
    path = write_gguf(tmp_path / "m.gguf", hf_tensors(), tokenizer_pre="smollm")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathlib import Path\n"
        "from gateway.launcher.serve_config import context_window\n"
        f"print(context_window(Path({str(path)!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(CONTEXT)]


# -- the referee on synthetic files ---------------------------------------------------------

CASES = {
    "llama_tied_with_bos": {"arch": "llama", "tied": True, "bias": False, "add_bos": True},
    "llama_untied_without_bos": {"arch": "llama", "tied": False, "bias": False, "add_bos": False},
    "qwen2_with_attention_biases": {"arch": "qwen2", "tied": False, "bias": True, "add_bos": False},
}


@pytest.mark.referee
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_llm_on_a_synthetic_gguf_matches_transformers_on_the_same_file(
    tmp_path: Path, case: str
) -> None:
    transformers = pytest.importorskip("transformers")
    spec = CASES[case]
    path = write_gguf(
        tmp_path / "m.gguf",
        hf_tensors(tied=spec["tied"], bias=spec["bias"], scale=0.5),
        arch=spec["arch"],
        tokenizer_pre="qwen2" if spec["arch"] == "qwen2" else "smollm",
        add_bos_token=spec["add_bos"],
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert model.config.tie_word_embeddings == spec["tied"]

    llm = LLM(model=str(path), dtype="float32")
    prompts = [llm.engine.tokenizer.encode(text) for text in TEXTS]
    assert prompts == [hf_tokenizer(text).input_ids for text in TEXTS]
    assert all((p[0] == 1) == spec["add_bos"] for p in prompts)

    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            reference = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert output.token_ids == reference.sequences[0, len(prompt) :].tolist()
        expected = [
            torch.log_softmax(logits[0], dim=-1)[token].item()
            for logits, token in zip(reference.logits, output.token_ids, strict=True)
        ]
        assert output.logprobs is not None
        ours = [entry.logprob for entry in output.logprobs]
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
