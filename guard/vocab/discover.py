"""Finding the token embedding and the output head (lm_head) of a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torch import nn

from guard.errors import AttachError
from guard.quote import quote
from guard.vocab import megatron
from guard.vocab.names import HEAD_NAMES
from guard.wrappers import unwrap

__all__ = ["Heads", "discover", "find_heads", "weight_shape"]

# Names used by nanoGPT, HF, Llama-style and Megatron-style code for the output projection.
# ... and for the final norm whose output the head projects (GPT-2 / nanoGPT ln_f, Llama /
# Mistral norm, OPT / T5 final_layer_norm, Megatron final_layernorm, GPT-NeoX final_layer_norm).
_FINAL_NORM_NAMES = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "ln_final", "norm_f")


@dataclass(frozen=True)
class Heads:
    """The two modules the guard hooks, and whether they share one weight."""

    embedding: nn.Module
    lm_head: nn.Module
    embedding_name: str
    lm_head_name: str
    # The module whose output the head projects, where one is found by name and width: a
    # forward that skips the head (a fused loss kernel) is measured from its output.
    final_norm: nn.Module | None = None
    # Every module that embeds ids with the embedding's weight: the embedding, and the
    # encoder's / decoder's own embedding modules that share it (T5, BART): each is watched.
    others: tuple[nn.Module, ...] = ()
    # The module whose weight the head projects with, when the head has none of its own:
    # torchtune's TiedLinear calls a weightless `linear` module with the tied embedding's.
    head_weights: nn.Module | None = None

    @property
    def inputs(self) -> tuple[nn.Module, ...]:
        return (self.embedding, *self.others)

    @property
    def head_holder(self) -> nn.Module:
        """The module that holds the head's weight (and bias): the head itself, mostly."""
        return self.head_weights if self.head_weights is not None else self.lm_head

    @property
    def tied(self) -> bool:
        w_in, w_out = _weight(self.embedding), _weight(self.head_holder)
        return w_in is not None and w_in is w_out

    @property
    def embedding_rows(self) -> int:
        return _rows(self.embedding, self.embedding_name)

    @property
    def head_rows(self) -> int:
        return _rows(self.head_holder, self.lm_head_name)


def weight_shape(w: object) -> tuple[int, ...]:
    """A parameter's whole shape: its own, or under DeepSpeed ZeRO-3, where outside a forward
    the parameter is an empty partition (`shape == [0]`), the one `ds_shape` keeps."""
    shape = getattr(w, "ds_shape", None) if hasattr(w, "ds_id") else None
    return tuple(int(n) for n in (shape if shape is not None else getattr(w, "shape", ())))


def _weight(m: object) -> object:
    return getattr(m, "weight", None)


def _rows(m: nn.Module, name: str) -> int:
    shape = weight_shape(getattr(m, "weight", None))
    if len(shape) != 2:
        raise AttachError(
            f"{name} ({type(m).__name__}) has no 2-D weight; pass embedding= / lm_head="
        )
    return shape[0]  # Embedding (rows, d) and Linear (out, in) both keep the vocab first


def _name_of(model: nn.Module, target: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is target:
            return name or "<model>"
    return f"<{type(target).__name__} outside the model>"


def _hf_heads(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return None, None
    try:
        return get_in(), get_out()
    except (NotImplementedError, AttributeError):
        return None, None


def _linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or megatron.is_column_parallel(m)


def _embedding(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) or megatron.is_vocab_parallel_embedding(m)


def _find_head(model: nn.Module, emb: nn.Module | None) -> nn.Module:
    linears: list[tuple[str, nn.Module]] = [(n, m) for n, m in model.named_modules()
                                            if _linear(m)]
    named = [(n, m) for n, m in linears if n.rsplit(".", 1)[-1] in HEAD_NAMES]
    if len(named) == 1:
        return named[0][1]
    # Without a name, the head is the Linear whose outputs match an embedding's rows.
    if emb is not None:
        rows = {getattr(emb, "num_embeddings", None)}
    else:
        rows = {getattr(m, "num_embeddings", None) for m in model.modules() if _embedding(m)}
    shaped = [(n, m) for n, m in linears if megatron.out_features(m) in rows]
    if len(shaped) == 1:
        return shaped[0][1]
    seen = ", ".join(f"{n} ({type(m).__name__} ->{megatron.out_features(m)})"
                     for n, m in (named or shaped))
    wanted = " or ".join(str(r) for r in sorted(r for r in rows if r is not None)) or "vocab"
    raise AttachError(
        "cannot find the output head: "
        + (f"several candidates: {seen}" if seen else "no nn.Linear named lm_head/output/head "
           f"and none with {wanted} outputs")
        + "; pass lm_head=<the module that produces the logits>"
    )


def _tied_parts(obj: object) -> tuple[nn.Module, nn.Module] | None:
    """torchtune's TiedLinear, which is no nn.Module: the module it calls (`.linear`, given
    the weight) and the module whose weight that is (`.tied_module`)."""
    linear, owner = getattr(obj, "linear", None), getattr(obj, "tied_module", None)
    if isinstance(linear, nn.Module) and isinstance(owner, nn.Module) \
            and not isinstance(obj, nn.Module):
        return linear, owner
    return None


def _find_tied_linear(model: nn.Module) -> tuple[str, nn.Module, nn.Module] | None:
    """(name, module called, weight holder) of a TiedLinear head: a plain attribute of a module
    (not a registered submodule), under one of the head names."""
    for name, m in model.named_modules():
        for attr in HEAD_NAMES:
            if (parts := _tied_parts(m.__dict__.get(attr))) is not None:
                return (f"{name}.{attr}" if name else attr), *parts
    return None


def _find_embedding(model: nn.Module, head: nn.Module) -> nn.Module:
    embs: list[tuple[str, nn.Module]] = [(n, m) for n, m in model.named_modules()
                                         if _embedding(m)]
    tied = [(n, m) for n, m in embs if m.weight is getattr(head, "weight", None)]
    if len(tied) == 1:
        return tied[0][1]
    rows = megatron.out_features(head)
    shaped = [(n, m) for n, m in embs if m.num_embeddings == rows]
    if len(shaped) == 1:
        return shaped[0][1]
    if not shaped and len(embs) == 1:
        return embs[0][1]
    seen = ", ".join(f"{n} ({type(m).__name__} {m.num_embeddings}x{m.embedding_dim})"
                     for n, m in embs)
    raise AttachError(
        "cannot find the token embedding: "
        + (f"candidates {seen}" if seen else "the model has no nn.Embedding")
        + "; pass embedding=<the token embedding module>"
    )


def _find_final_norm(model: nn.Module, head: nn.Module) -> nn.Module | None:
    width = (weight_shape(getattr(head, "weight", None)) or (0,))[-1]
    named = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in _FINAL_NORM_NAMES
             and weight_shape(getattr(m, "weight", None)) == (width,)]
    return named[-1] if named else None  # the last: decoder stacks name their inner norms too


def _sharing(model: nn.Module, emb: nn.Module, head: nn.Module) -> tuple[nn.Module, ...]:
    """The other embedding modules of `model` whose weight is the embedding's own tensor."""
    w = _weight(emb)
    if not isinstance(w, nn.Parameter):
        return ()
    return tuple(m for m in model.modules() if isinstance(m, nn.Embedding)
                 and m is not emb and m is not head and m.weight is w)


def discover(
    model: nn.Module, *, embedding: nn.Module | None = None, lm_head: nn.Module | None = None
) -> Heads:
    """Explicit modules win, then HF accessors, then names and shapes (nanoGPT wte / lm_head)."""
    for label, given in (("embedding", embedding), ("lm_head", lm_head)):
        # Given is given (`is not None`, never truthiness: an empty nn.Sequential is falsy, and
        # 0, False, "" or [] were taken for "find it"): a module, or torchtune's TiedLinear.
        if given is not None and not isinstance(given, nn.Module) and \
                (label == "embedding" or _tied_parts(given) is None):
            raise AttachError(f"{label}= must be the model's {label} module (an nn.Module), "
                              f"got {quote(given)} ({type(given).__name__})")
    hf_in, hf_out = _hf_heads(model)
    emb = embedding if embedding is not None else hf_in
    head: object = lm_head if lm_head is not None else hf_out
    name, holder = None, None
    tied = _find_tied_linear(model) if head is None or _weight(head) is None else None
    if (parts := _tied_parts(head)) is not None:  # lm_head=model.output, a TiedLinear
        head, holder = parts
    elif tied is not None and head in (None, tied[1]):  # found, or lm_head=model.output.linear
        name, head, holder = tied
    if head is None:
        head = _find_head(model, emb)
    elif holder is None and _weight(head) is None:  # given, or HF's, and holds no weight
        raise AttachError(f"lm_head ({type(head).__name__}) has no weight: pass lm_head=<the "
                          "module that produces the logits> (an nn.Linear, a TiedLinear)")
    for label, m in (("embedding", emb), ("lm_head", head)):
        if m is not None and not isinstance(m, nn.Module):
            raise AttachError(f"{label} must be an nn.Module, got {type(m).__name__}")
    out = cast(nn.Module, head)  # checked just above
    if emb is None:
        emb = _find_embedding(model, holder or out)
    heads = Heads(emb, out, _name_of(model, emb), name or _name_of(model, out),
                  _find_final_norm(model, holder or out), _sharing(model, emb, out), holder)
    heads.embedding_rows, heads.head_rows  # noqa: B018 - raises AttachError early on odd modules
    return heads


def find_heads(model: object, *, embedding: nn.Module | None = None,
               lm_head: nn.Module | None = None) -> Heads:
    """The embedding and the lm_head `attach` would hook in `model` (under any wrapper), with
    their names."""
    return discover(unwrap(model), embedding=embedding, lm_head=lm_head)
