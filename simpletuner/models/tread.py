"""TREAD token routing (SimpleTuner's ``tread_config``): while training, a random part of each sample's image tokens
skips a range of transformer blocks, rejoining the sequence unchanged after it.

A route ``(selection_ratio, start, end)`` covers blocks ``start..end`` (inclusive, SimpleTuner's numbering:
:data:`LAYOUTS`; a negative index counts from the end). Before block ``start`` each sample keeps
``S - round(S * selection_ratio)`` of its ``S`` tokens, drawn uniformly from the run's noise generator (one draw of
``[B, S]`` per route and forward; tokens a loss mask covers are always kept); the kept tokens, with their rotary
embedding rows, go through the route's blocks; after block ``end`` they are written back into the sequence as it was
before ``start``. Routes run in order and do not overlap. Only a denoiser in training mode with gradients on routes:
validation, the regularisation target and eval mode see every token. The loss covers every token.

The routing is a layer of forward hooks on the blocks of diffusers' own transformers (their forward is not copied):
a pre-hook on the transformer starts a forward, a pre-hook on each routed block swaps in the kept tokens, rotary rows
and per-token arguments, and a post-hook on each route's last block scatters the tokens back. Flux's and Qwen-Image's
attention processors take one rotary table for the batch; with per-sample selections their routed blocks' attention
runs once per sample (:class:`PerSampleAttention`). Meaning next to SimpleTuner: documentation/MODEL_FAMILIES.md,
"TREAD token routing".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

logger = logging.getLogger(__name__)

#: Where a transformer keeps its router (a plain attribute: not a submodule, not in the state dict).
ROUTER_ATTRIBUTE = "_tread_router"


class RouteSettings(Protocol):
    """One ``tread_config.routes`` entry as the config holds it."""

    selection_ratio: float
    start_layer_idx: int
    end_layer_idx: int


@dataclass(frozen=True)
class Route:
    """A route with its block indices resolved: blocks ``start..end`` (inclusive) see the kept tokens only."""

    selection_ratio: float
    start: int
    end: int


# --- what each family routes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleRotaries:
    """Per-sample rotary embeddings (one entry per sample, each in the family's own form) for an attention processor
    that takes one table for the batch: :class:`PerSampleAttention` runs it once per sample."""

    parts: tuple[Any, ...]


Rotary = Any
#: ``(rotary, keep, arguments)`` -> the rotary embedding of the kept tokens; ``keep`` is ``[B, K]`` token indices,
#: ``arguments`` the block call's arguments by name.
RouteRotary = Callable[[Rotary, torch.Tensor, dict[str, Any]], Rotary]


def _text_then_image(rotary: Rotary, keep: torch.Tensor, arguments: dict[str, Any]) -> SampleRotaries:
    """Flux: ``(cos, sin)``, each ``[S_text + S_image, D]``, text rows first (both stream layouts of diffusers 0.42)."""
    num_text = arguments["encoder_hidden_states"].shape[1]
    return SampleRotaries(
        tuple(tuple(torch.cat([table[:num_text], table[num_text:][rows]]) for table in rotary) for rows in keep)
    )


def _image_and_text(rotary: Rotary, keep: torch.Tensor, arguments: dict[str, Any]) -> SampleRotaries:
    """Qwen-Image: ``(image_freqs [S_image, D/2], text_freqs)``."""
    image, text = rotary
    return SampleRotaries(tuple((image[rows], text) for rows in keep))


def _batched_rows(rotary: Rotary, keep: torch.Tensor, arguments: dict[str, Any]) -> Rotary:
    """Wan: ``(cos, sin)``, each ``[1, S, 1, D]``; its processor broadcasts a batch of tables: ``[B, K, 1, D]``."""
    return tuple(table[0][keep] for table in rotary)


@dataclass(frozen=True)
class Layout:
    """What one transformer class routes.

    ``block_lists``: its attributes holding the blocks, in SimpleTuner's numbering order (Flux: the double-stream
    blocks, then the single-stream ones), with ``count_keys`` the config keys of their lengths. ``tokens``: the block
    argument holding the image tokens ``[B, S, D]``; ``rotary`` the one holding their rotary embedding (None: the
    positions were added before the blocks) and ``route_rotary`` how it follows the kept tokens; ``per_token``: block
    arguments with one entry per token when they have that many dimensions (gathered too); ``output``: where the
    tokens are in the block's output tuple (None: the output is the tokens); ``per_sample_attention``: the blocks'
    attention takes :class:`SampleRotaries`, run per sample."""

    block_lists: tuple[str, ...]
    count_keys: tuple[str, ...]
    tokens: str = "hidden_states"
    rotary: str | None = None
    route_rotary: RouteRotary | None = None
    per_token: tuple[tuple[str, int], ...] = ()
    output: int | None = 1
    per_sample_attention: bool = False


#: diffusers 0.42's transformer classes, by class name.
LAYOUTS: dict[str, Layout] = {
    "FluxTransformer2DModel": Layout(
        ("transformer_blocks", "single_transformer_blocks"),
        ("num_layers", "num_single_layers"),
        rotary="image_rotary_emb",
        route_rotary=_text_then_image,
        per_sample_attention=True,
    ),
    "WanTransformer3DModel": Layout(
        ("blocks",),
        ("num_layers",),
        rotary="rotary_emb",
        route_rotary=_batched_rows,
        per_token=(("temb", 4),),  # Wan 2.2 TI2V: [B, S, 6, D] timestep embeddings, one per token
        output=None,
    ),
    "QwenImageTransformer2DModel": Layout(
        ("transformer_blocks",),
        ("num_layers",),
        rotary="image_rotary_emb",
        route_rotary=_image_and_text,
        per_token=(("modulate_index", 2),),  # zero_cond_t: [B, S] which modulation each token takes
        per_sample_attention=True,
    ),
    "SD3Transformer2DModel": Layout(("transformer_blocks",), ("num_layers",)),
}


def layout_of(class_name: str) -> Layout:
    """The :class:`Layout` of a transformer class.

    Raises:
        ValueError: the class has none (TREAD routes these transformers only).
    """
    try:
        return LAYOUTS[class_name]
    except KeyError:
        raise ValueError(
            f"tread_config: TREAD routes the tokens of {', '.join(LAYOUTS)}, not of a {class_name}: remove tread_config"
        ) from None


def blocks_of(denoiser: nn.Module, layout: Layout) -> list[nn.Module]:
    """The transformer's blocks in SimpleTuner's numbering."""
    return [block for name in layout.block_lists for block in getattr(denoiser, name)]


# --- the routes ----------------------------------------------------------------------------------------------------
def route_problems(routes: Sequence[RouteSettings], num_blocks: int, where: str) -> list[str]:
    """One line per route that does not fit a transformer of ``num_blocks`` blocks (``where`` names it): an index
    outside it, a start after its end, or a route that does not begin after the one before it ends."""
    problems = []
    previous_end = None
    for i, settings in enumerate(routes):
        name = f"tread_config.routes[{i}]"
        indices = []
        for key in ("start_layer_idx", "end_layer_idx"):
            given = getattr(settings, key)
            block = given + num_blocks if given < 0 else given
            if not 0 <= block < num_blocks:
                problems.append(
                    f"{name}.{key} {given} is outside the {num_blocks} blocks of {where} (0 to {num_blocks - 1}, or "
                    f"-{num_blocks} to -1 from the end): use an index inside"
                )
            indices.append(block)
        start, end = indices
        if not (0 <= start < num_blocks and 0 <= end < num_blocks):
            previous_end = None
            continue
        if start > end:
            problems.append(
                f"{name} starts at block {start} (start_layer_idx {settings.start_layer_idx}) after it ends at block "
                f"{end} (end_layer_idx {settings.end_layer_idx}) of the {num_blocks} of {where}: swap them"
            )
        elif previous_end is not None and start <= previous_end:
            problems.append(
                f"{name} starts at block {start}, not after block {previous_end} where routes[{i - 1}] ends: routes "
                f"run in order and must not overlap (SimpleTuner skips such a route and the ones after it): start it "
                f"at block {previous_end + 1} or later"
            )
        previous_end = end if start <= end else previous_end
    return problems


def resolve_routes(routes: Sequence[RouteSettings], num_blocks: int, where: str) -> list[Route]:
    """The routes with their block indices resolved (negative: from the end).

    Raises:
        ValueError: :func:`route_problems`, one line each.
    """
    problems = route_problems(routes, num_blocks, where)
    if problems:
        raise ValueError("\n".join(problems))
    return [
        Route(
            float(r.selection_ratio),
            r.start_layer_idx + num_blocks if r.start_layer_idx < 0 else r.start_layer_idx,
            r.end_layer_idx + num_blocks if r.end_layer_idx < 0 else r.end_layer_idx,
        )
        for r in routes
    ]


def num_blocks_in(config: dict[str, Any], layout: Layout) -> int | None:
    """How many blocks a transformer ``config.json`` describes; None when it does not say."""
    total = 0
    for key in layout.count_keys:
        count = config.get(key)
        if not isinstance(count, int) or isinstance(count, bool):
            return None
        total += count
    return total


def num_kept(num_tokens: int, selection_ratio: float) -> int:
    """Tokens a sample keeps: ``S - round(S * selection_ratio)`` (SimpleTuner's budget, Python's rounding), at least
    one."""
    return max(num_tokens - int(round(num_tokens * selection_ratio)), 1)


def select_tokens(noise: torch.Tensor, num_keep: int, force_keep: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[B, K]`` token indices each sample keeps, ascending: its ``K`` lowest ``noise`` values (``[B, S]``, uniform),
    the ``force_keep`` tokens (``[B, S]`` bool) first; ``K`` grows to the most any sample must keep. None when every
    token is kept."""
    if force_keep is not None:
        num_keep = max(num_keep, int(force_keep.sum(dim=1).max()))  # one sync, masked batches only
        noise = noise.masked_fill(force_keep, -1.0)
    if num_keep >= noise.shape[1]:
        return None
    return noise.argsort(dim=1)[:, :num_keep].sort(dim=1).values


# --- the hooks -----------------------------------------------------------------------------------------------------
def _gather(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``tensor[b, keep[b]]`` along dimension 1, for a tensor of any rank >= 2."""
    index = keep.reshape(*keep.shape, *([1] * (tensor.ndim - 2))).expand(-1, -1, *tensor.shape[2:])
    return tensor.gather(1, index)


class TokenRouter:
    """The routing state of one transformer: its routes, and per forward the kept tokens of each route, the full
    sequence each route started from and the routed rotary embeddings (kept until the next forward: a
    gradient-checkpointed block runs its hooks again in backward and must route the same tokens)."""

    def __init__(self, layout: Layout, routes: list[Route], blocks: list[nn.Module]):
        self.layout = layout
        self.routes = routes
        #: Set for the duration of a training forward (:func:`routing_draws`): where the draws come from, and the
        #: ``[B, S]`` tokens that must be kept (a loss mask).
        self.generator: torch.Generator | None = None
        self.force_keep: torch.Tensor | None = None
        self._active = False
        self._keep: dict[int, torch.Tensor | None] = {}
        self._full: dict[int, torch.Tensor] = {}
        self._rotary: dict[int, Rotary] = {}
        self._route_of = {i: r for r, route in enumerate(routes) for i in range(route.start, route.end + 1)}
        self._signatures = {i: inspect.signature(blocks[i].forward) for i in self._route_of}

    def begin(self, module: nn.Module, args: Any) -> None:
        """Transformer pre-hook: a new forward; it routes in training mode with gradients on."""
        self._active = bool(self.routes) and module.training and torch.is_grad_enabled()
        self._keep.clear()
        self._full.clear()
        self._rotary.clear()

    def kept(self, r: int) -> torch.Tensor | None:
        """``[B, K]`` the tokens route ``r`` kept in the last forward; None: it routed nothing."""
        return self._keep.get(r)

    def _select(self, r: int, tokens: torch.Tensor) -> torch.Tensor | None:
        if r in self._keep:  # the forward's selection (a checkpointed block runs again in backward)
            return self._keep[r]
        batch, num_tokens = tokens.shape[:2]
        keep = None
        num_keep = num_kept(num_tokens, self.routes[r].selection_ratio)
        if num_keep < num_tokens:  # selection_ratio 0 draws nothing: the run is the one without routing
            noise = torch.rand((batch, num_tokens), generator=self.generator).to(tokens.device)
            force = self.force_keep
            if force is None or is_fake(force) or force.shape[0] != batch or force.shape[1] > num_tokens:
                force = None  # none; the memory estimate's (no values); or one that is not of these tokens
            else:
                force = torch.nn.functional.pad(force.to(tokens.device), (0, num_tokens - force.shape[1]))
            keep = select_tokens(noise, num_keep, force)
        self._keep[r] = keep
        return keep

    def before_block(
        self, index: int, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Block pre-hook: at a route's start, keep the selected tokens; in the route, the kept tokens' rotary rows
        and per-token arguments."""
        if not self._active:
            return None
        r = self._route_of[index]
        layout = self.layout
        bound = self._signatures[index].bind(*args, **kwargs)
        arguments = bound.arguments
        if index == self.routes[r].start:
            tokens = arguments[layout.tokens]
            keep = self._select(r, tokens)
            if keep is None:
                return None
            self._full[r] = tokens
            arguments[layout.tokens] = _gather(tokens, keep)
        keep = self._keep.get(r)
        if keep is None:
            return None
        rotary_name, route_rotary = layout.rotary, layout.route_rotary
        if rotary_name is not None and route_rotary is not None and arguments.get(rotary_name) is not None:
            if r not in self._rotary:
                self._rotary[r] = route_rotary(arguments[rotary_name], keep, arguments)
            arguments[rotary_name] = self._rotary[r]
        for name, ndim in layout.per_token:
            value = arguments.get(name)
            if isinstance(value, torch.Tensor) and value.ndim == ndim:
                arguments[name] = _gather(value, keep)
        return bound.args, bound.kwargs

    def after_block(
        self, index: int, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Post-hook of a route's last block: the kept tokens back among the others, as they were at its start."""
        if not self._active:
            return None
        r = self._route_of[index]
        keep = self._keep.get(r)
        if keep is None:
            return None
        position = self.layout.output
        routed = output if position is None else output[position]
        full = self._full[r].to(routed.dtype)
        merged = full.scatter(1, keep.unsqueeze(-1).expand(-1, -1, full.shape[-1]), routed)
        if position is None:
            return merged
        return (*output[:position], merged, *output[position + 1 :])


class PerSampleAttention:
    """An attention processor run once per sample when the rotary embedding is per sample (:class:`SampleRotaries`),
    else the wrapped processor as it is. The signature names every argument Flux's and Qwen-Image's attention modules
    pass (they drop keyword arguments a processor does not name)."""

    def __init__(self, processor: Any):
        self.processor = processor

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> Any:
        def call(b: int | None, rotary: Any) -> Any:
            def part(t: torch.Tensor | None) -> torch.Tensor | None:
                return t if t is None or b is None else t[b : b + 1]

            extra = (
                {}
                if encoder_hidden_states_mask is None
                else {"encoder_hidden_states_mask": part(encoder_hidden_states_mask)}
            )
            return self.processor(
                attn,
                part(hidden_states),
                encoder_hidden_states=part(encoder_hidden_states),
                attention_mask=part(attention_mask),
                image_rotary_emb=rotary,
                **extra,
            )

        if not isinstance(image_rotary_emb, SampleRotaries):
            return call(None, image_rotary_emb)
        outputs = [call(b, rotary) for b, rotary in enumerate(image_rotary_emb.parts)]
        if isinstance(outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        return torch.cat(outputs)


def install_token_routing(denoiser: nn.Module, routes: Sequence[RouteSettings]) -> TokenRouter:
    """Route ``denoiser``'s tokens (a diffusers transformer of :data:`LAYOUTS`) along ``routes``: hooks on the
    transformer and on the routed blocks; with a per-sample attention family, :class:`PerSampleAttention` on the
    routed blocks' attention. Returns the router, also kept on the transformer (:data:`ROUTER_ATTRIBUTE`).

    Raises:
        ValueError: a transformer TREAD does not route, or routes that do not fit its blocks.
    """
    layout = layout_of(type(denoiser).__name__)
    blocks = blocks_of(denoiser, layout)
    resolved = resolve_routes(routes, len(blocks), f"the {type(denoiser).__name__}")
    router = TokenRouter(layout, resolved, blocks)
    denoiser.register_forward_pre_hook(router.begin)
    for route in resolved:
        for index in range(route.start, route.end + 1):
            block = blocks[index]
            block.register_forward_pre_hook(functools.partial(router.before_block, index), with_kwargs=True)
            if layout.per_sample_attention:
                attn: Any = block.attn
                if not isinstance(attn.processor, PerSampleAttention):
                    attn.set_processor(PerSampleAttention(attn.processor))
        blocks[route.end].register_forward_hook(functools.partial(router.after_block, route.end), with_kwargs=True)
    setattr(denoiser, ROUTER_ATTRIBUTE, router)
    logger.info("%s", describe_routes(resolved, len(blocks), type(denoiser).__name__))
    return router


def describe_routes(routes: Sequence[Route], num_blocks: int, model: str) -> str:
    """One line saying what the routes do, as logged at start (blocks numbered from 0, ends included)."""
    parts = [
        f"{r.selection_ratio:.0%} of each sample's image tokens skip blocks {r.start}-{r.end}" for r in routes
    ] or ["no route"]
    return f"TREAD token routing in the {model} ({num_blocks} blocks) while training: {'; '.join(parts)}"


def routers_in(model: nn.Module) -> list[TokenRouter]:
    """The routers of the transformers inside ``model`` (itself, a wrapper's module, Wan 2.2's experts)."""
    return [r for m in model.modules() if isinstance(r := m.__dict__.get(ROUTER_ATTRIBUTE), TokenRouter)]


@contextlib.contextmanager
def routing_draws(
    model: nn.Module, generator: torch.Generator | None, force_keep: torch.Tensor | None = None
) -> Iterator[None]:
    """Forwards of ``model`` inside draw their selections from ``generator`` (the run's noise generator: saved in
    checkpoints, so a resumed run routes as the uninterrupted one; None: torch's default generator) and keep the
    ``force_keep`` tokens (``[B, S_image]`` bool, in the transformer's token order; tokens after them are free)."""
    routers = routers_in(model)
    for router in routers:
        router.generator, router.force_keep = generator, force_keep
    try:
        yield
    finally:
        for router in routers:
            router.generator = router.force_keep = None


def token_mask(loss_mask: torch.Tensor | None, patch: int) -> torch.Tensor | None:
    """``[B, S]`` tokens a latent loss mask (``[B, 1, h, w]``) covers: a ``patch`` x ``patch`` cell's mean above 0.5
    (SimpleTuner's area-downsampled mask), row by row as the transformers lay out their tokens."""
    if loss_mask is None:
        return None
    return torch.nn.functional.avg_pool2d(loss_mask.float(), patch).flatten(1) > 0.5
