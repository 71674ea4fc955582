"""Where a pretrained checkpoint (``model.pretrained``, ``model.init_from``) comes from, checked without torch or
transformers: a local folder in the ``save_pretrained`` layout, or a hub id in the Hugging Face cache or on a hub
that answers. The command line asks this before it starts anything, so that an offline machine hears within seconds
that a hub id is missing, not after the servers have started.

    from training.models.hub import check_source
    check_source("hfl/chinese-roberta-wwm-ext")   # PretrainedError naming model.pretrained when it cannot be had
"""

from __future__ import annotations

import os
from pathlib import Path

from training.config import ConfigError

# a tokenizer's vocabulary as save_pretrained writes it (without one, AutoTokenizer builds the config's tokenizer class
# with nothing but its special tokens, and every text becomes [UNK])
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")

# the weights as save_pretrained writes them, in one file or in shards with their index
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class PretrainedError(ConfigError):
    """``model.pretrained`` cannot be loaded; the message says how to make it available."""


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def unavailable(source: str, err: Exception) -> PretrainedError:
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    why = " (HF_HUB_OFFLINE is set)" if offline() else ""
    return PretrainedError(
        f"model.pretrained: {source!r} is not a local folder and not in the Hugging Face cache ({home}), and it could "
        f"not be downloaded{why}: {reason.rstrip('.')}. Make it available: give a local folder in the save_pretrained layout "
        f"(config.json, weights, tokenizer files), point HF_HOME at a cache that holds it, or download it on a "
        f"connected machine (`hf download {source}`) and copy the folder or the cache here")


def hub_reachable(timeout: float = 3.0) -> str | None:
    """None if the hub answers a TCP connection within ``timeout`` seconds, else why not (a machine without internet
    would otherwise wait through huggingface_hub's retries)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
        return None
    except OSError as err:
        return f"{endpoint.hostname}:{port} cannot be reached ({err})"


def not_a_checkpoint(folder: Path, why: str) -> PretrainedError:
    return PretrainedError(f"model.pretrained: {str(folder)!r} is a folder but not a checkpoint in the save_pretrained "
                           f"layout: {why} (a checkpoint folder holds config.json, the weights and the tokenizer's "
                           f"files, as model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR) write them)")


def in_cache(source: str) -> bool:
    """Whether the Hugging Face cache holds the hub id's config (a download made before, on this machine or copied)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(source, "config.json"), str)
    except ValueError as err:  # not a valid repo id
        raise unavailable(source, err) from None


def check_source(source: str | None) -> None:
    """Fail fast (before any run is opened) when ``model.pretrained`` is missing, is a folder that is not a
    checkpoint, or is a hub id that neither the cache holds nor a reachable hub can give. Whether the config then
    loads is the family's check (``training.models.pretrained``), with transformers."""
    if not source:
        raise PretrainedError("model.pretrained: the pretrained family needs a checkpoint: a local folder in the "
                              "save_pretrained layout or a hub id (--pretrained X)")
    folder = Path(source).expanduser()
    if not folder.is_dir() and (source.startswith((".", "/", "~")) or folder.exists()):
        raise PretrainedError(f"model.pretrained: {source!r}: no such folder (a local checkpoint is a folder in the "
                              "save_pretrained layout; anything else is taken as a hub id)")
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise not_a_checkpoint(folder, "it has no config.json")
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise not_a_checkpoint(folder, "it has no tokenizer vocabulary (none of " + ", ".join(TOKENIZER_FILES) + ")")
        if not any((folder / name).is_file() for name in WEIGHT_FILES):  # found now, not by the worker minutes later
            raise not_a_checkpoint(folder, "it has no weights (none of " + ", ".join(WEIGHT_FILES) + ")")
    elif not in_cache(source):
        if offline():
            raise unavailable(source, OSError("not in the cache, and the hub may not be asked"))
        if (why := hub_reachable()) is not None:
            raise unavailable(source, OSError(why))
