"""What both front doors (surge.LLM and the server) do to a pooling request before the engine core sees it: check
that the model serves the task and the parameters fit it, cut or refuse a prompt longer than the model takes, and
pair the texts a cross-encoder scores together.
"""
from __future__ import annotations

from surge.config import ModelConfig
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams

# A pooling request computes its prompt only; its output is the pooled one.
PROMPT_ONLY = SamplingParams(max_tokens=0)


class WrongRunnerError(ValueError):
    """The model does not run the kind of request asked (a generative model asked to embed, or the reverse)."""


def check_pooling_task(model_config: ModelConfig, task: str, what: str) -> None:
    """`what` (e.g. "LLM.embed", "/v1/embeddings") needs a pooling model that serves `task`."""
    if model_config.runner != "pooling":
        raise WrongRunnerError(f"{what} needs a pooling model, but model {model_config.model!r} runs with "
                               f"runner={model_config.runner!r}; start it with runner='pooling' (--runner pooling)")
    if task not in model_config.pooling_tasks:
        kind = "a classifier (cross-encoder)" if model_config.is_cross_encoder else "an embedding model"
        raise WrongRunnerError(f"{what} ({task}) is not supported by model {model_config.model!r}, {kind}; it "
                               f"serves {', '.join(model_config.pooling_tasks)}")
    if task == "score" and model_config.is_cross_encoder and model_config.num_labels != 1:
        raise WrongRunnerError(f"{what}: a score is one value, but model {model_config.model!r} classifies into "
                               f"{model_config.num_labels} labels; use classify")


def check_generation(model_config: ModelConfig, what: str) -> None:
    if model_config.runner != "generate":
        raise WrongRunnerError(f"{what} needs a generative model, but model {model_config.model!r} runs with "
                               f"runner={model_config.runner!r}: it serves {', '.join(model_config.pooling_tasks)}")


def pooling_params_for(model_config: ModelConfig, params: PoolingParams | None, task: str) -> PoolingParams:
    """The request's params with its task set, checked against the model: dimensions only where the model declares
    Matryoshka embeddings, and only sizes it declares."""
    params = (params or PoolingParams()).clone(task=task)
    dims = params.dimensions
    if dims is not None:
        if not model_config.is_matryoshka:
            raise ValueError(f"dimensions={dims}: model {model_config.model!r} does not support Matryoshka "
                             "representation (no matryoshka_dimensions or is_matryoshka in its config); changing "
                             "its output dimensions is refused")
        allowed = model_config.matryoshka_dimensions
        if allowed and dims not in allowed:
            raise ValueError(f"dimensions={dims}: model {model_config.model!r} supports only {allowed}")
        if dims > model_config.hidden_size:
            raise ValueError(f"dimensions={dims} exceeds the model's embedding size {model_config.hidden_size}")
    return params


def fit_prompt(token_ids: list[int], params: PoolingParams, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: max_model_len) when asked; a prompt longer than the
    model takes is refused, never cut silently."""
    keep = params.truncate_prompt_tokens
    if keep is not None:
        keep = max_model_len if keep == -1 else keep
        if keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_model_len}")
        token_ids = token_ids[-keep:]
    if len(token_ids) > max_model_len:
        raise ValueError(f"the input has {len(token_ids)} tokens, more than this model's maximum context length "
                         f"max_model_len={max_model_len}; shorten it or pass truncate_prompt_tokens")
    if not token_ids:
        raise ValueError("the input is empty: at least one token is needed")
    return token_ids


def score_pairs(data_1: list, data_2: list) -> list[tuple]:
    """vLLM's pairing: one first text against each second text, or two lists of one length pairwise."""
    if len(data_1) == 1:
        data_1 = data_1 * len(data_2)
    if len(data_1) != len(data_2):
        raise ValueError(f"score: text_1 has {len(data_1)} entries and text_2 {len(data_2)}; give one text_1, or "
                         "as many as text_2")
    if not data_2:
        raise ValueError("score: text_2 is empty")
    return list(zip(data_1, data_2))


def pair_token_ids(tokenizer, first, second) -> list[int]:
    """A cross-encoder's input: the two texts as the tokenizer joins a pair (its separators, if any), or two token
    id lists joined."""
    if isinstance(first, str) and isinstance(second, str):
        return list(tokenizer(text=first, text_pair=second)["input_ids"])
    if isinstance(first, list) and isinstance(second, list):
        return list(first) + list(second)
    raise ValueError("score: each pair must be two strings or two lists of token ids")
