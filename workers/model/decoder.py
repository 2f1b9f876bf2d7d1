"""The model step on KV slots for Llama-family models (Llama, Mistral, Qwen2, Qwen3).

The weights of a loaded transformers model are taken over once, with the query, key and value
projections fused into one matrix and the gate and up projections into another (fewer, larger
matrix products per layer). A step's tokens (one per decoding sequence, then prompt chunks) go
through the layers as one flat batch, so the weights are read once per step however many
sequences decode or join; only attention is done per sequence.

Decoding rows: row ``b`` of the step is slot ``b``, so the keys a row attends to are a view of its
slot, never a gathered copy. Rows ``0..B-1`` all run; a row whose slot holds no decoding sequence
(free, or still being prefilled) is a dummy that writes into the slot's last position, which no
sequence uses (a sequence ends when its context fills the window, before the token at that
position is fed back), and whose output is dropped (through ``kernels.c`` it attends to nothing).

On a CPU, a step's attention, its RMS norms, the rotation of queries and keys with the cache writes
and its decoding products run through ``workers/model/cpu/kernels.c`` where it was built for the
host (``use_kernels``: ``workers.model.cpu.kernels``, ``workers.model.cpu.attention``); where all of
a layer does, the step's layers run in one call (``workers.model.cpu.layerstep``).

With ``compile`` the decoding-only step is compiled (``torch.compile``: C++ kernels on a CPU,
Triton kernels on a GPU, replayed there from CUDA graphs of batch-size buckets: ``cudagraphs``);
steps with prompt chunks run eagerly.
"""

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional

from workers.model.cpu import kernels
from workers.model.cpu.attention import DecodeAttention, StepRows, decode_attention
from workers.model.cpu.blocks import ALL_ROWS, BlockProduct, Blocks, BlockTensor
from workers.model.cpu.groups import GROUP, Groups4
from workers.model.cpu.layerstep import FUNCTIONS, LayerParts, LayerStep
from workers.model.cudagraphs import StepGraphs
from workers.model.kvcache import KvSlots
from workers.model.layers import Layer, NativeNorm, norm, rope_tables
from workers.model.linear import PREFILL_ROWS, Linear, NativeProduct, frozen
from workers.model.lmhead import OutputLayer
from workers.model.plan import StepPlan

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_BLOCK = 256  # with CUDA graphs, attention lengths are rounded up to this (fewer graphs)
# a step's decoding rows: how many, how many columns of their slots they attend to, and which (None: all)
Decoding = tuple[int, int, Tensor | None]
# the step's first rows through ``attention.DecodeAttention``: each row's slot and last column
KernelRows = tuple[np.ndarray, np.ndarray]


def unsupported_reason(model: Any) -> str | None:
    """Why this decoder cannot run the model (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind not in ARCHITECTURES:
        return f"architecture {kind!r} (the slot decoder runs {', '.join(ARCHITECTURES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3", "yarn"):
        return f"RoPE type {rope.get('rope_type')!r} (its frequencies depend on the sequence length)"
    if getattr(config, "use_sliding_window", False) or (
            kind == "mistral" and getattr(config, "sliding_window", None) is not None):
        return "sliding-window attention"
    return None


class Decoder(nn.Module):
    """A Llama-family model's forward pass over KV slots (``unsupported_reason`` says which)."""

    cos: Tensor
    sin: Tensor
    columns: Tensor

    def __init__(self, model: Any, slots: int, positions: int, compile: bool = False,
                 cache_dtype: torch.dtype | None = None) -> None:
        """``model``: a transformers model (its weights are taken over, not copied); ``positions``:
        the context window; ``compile``: compile the decoding step; ``cache_dtype``: the keys' and
        values' (None: the model's; ``workers.model.build.cache_dtype``)."""
        super().__init__()
        config = model.config
        base = model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.shape = (heads, kv_heads, head_dim)
        self.group = heads // kv_heads
        self.eps = config.rms_norm_eps
        self.embed = frozen(base.embed_tokens.weight)
        self.layers = nn.ModuleList(Layer(layer, config.rms_norm_eps) for layer in base.layers)
        self.typed_layers: list[Layer] = list(self.layers)  # type: ignore[arg-type]
        self.norm = frozen(base.norm.weight.float())
        self.lm_head = Linear(model.lm_head.weight)
        self.output = OutputLayer(self.lm_head)  # its logits on packed weights, refined
        # the norms' device: a model served on a GGUF file's blocks has its matrices on the meta device
        dtype, device = self.embed.dtype, base.norm.weight.device
        self.device = device
        self._embedding: Callable[[Tensor], Tensor] | None = None  # rows of the file's blocks (``use_blocks``)
        self.cache = KvSlots(len(self.layers), slots, kv_heads, positions, head_dim, cache_dtype or dtype, device)
        cos, sin = rope_tables(base.rotary_emb, positions, dtype, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # float32 tables for kernels.c's rotation (``use_kernels``; a CPU only, where they are used)
        self._rope_f32 = None if device.type != "cpu" else (cos, sin) if dtype == torch.float32 \
            else rope_tables(base.rotary_emb, positions, torch.float32, device)
        self.register_buffer("columns", torch.arange(positions, device=device), persistent=False)
        self.compiled = compile
        self.attention: DecodeAttention | None = None  # a step's attention on a CPU (``use_kernels``)
        self._kernels: kernels.Kernels | None = None
        self._native_norm: NativeNorm | None = None  # kernels.c's RMS norm (``use_kernels``)
        # kernels.c's rotation of queries and keys with the cache writes, bound to this model (``use_kernels``)
        self._rope_store: Callable[..., Tensor] | None = None
        self._layer_step: LayerStep | None = None  # the layers in one kernels.c call (``_one_call``)
        self._layer_step_known = False
        self.graphs = compile and device.type == "cuda"
        self._decode = self.logits
        self._graphs: StepGraphs | None = None
        if compile:
            # shapes stay symbolic: one compilation for every batch size and attention length
            self._decode = torch.compile(self.logits, dynamic=True)
        if self.graphs:
            self._graphs = StepGraphs(self._decode, self.columns, slots)

    @property
    def slots(self) -> int:
        return self.cache.slots

    def use_kernels(self, built: kernels.Kernels | None) -> None:
        """Run a step's attention (``workers.model.cpu.attention``), its RMS norms of float32 rows
        (``layers.norm``), the MLP's activation of float32 products (``Layer._activated``), the rotation
        of queries and keys with the cache writes (``Kernels.rope_store``; not for models that norm
        queries and keys before turning them), the output layer's 8-bit product (``OutputLayer``) and,
        where ``pack_int4`` packs after this, the layers' 4-bit products (``Linear.pack_int4``)
        through ``built`` where they apply; eager steps only (a compiled step keeps torch's). None:
        torch alone."""
        _, _, head_dim = self.shape
        self._kernels = self.output.kernels = built
        self.attention = decode_attention(built, self.group, head_dim, self.cache.positions)
        self._native_norm = None if built is None else built.rms_norm
        for layer in self.typed_layers:
            layer.native_norm = self._native_norm
            layer.native_activation = None if built is None else built.silu_mul
        self._rope_store, self._layer_step_known = None, False
        if built is not None and self._rope_f32 is not None and head_dim % 2 == 0 \
                and all(layer.q_norm is None for layer in self.typed_layers):
            self._rope_store = functools.partial(built.rope_store, heads=self.shape[0], tables=self._rope_f32)

    def use_blocks(self, built: Blocks, matrices: dict[str, BlockTensor]) -> None:
        """Run every product, prompt rows too, on a GGUF file's own blocks (``matrices``, by the model's
        parameter names: ``workers.model.gguf``), and take the embeddings from them; the model's own
        matrices are never read (on the meta device, they hold nothing)."""
        for i, layer in enumerate(self.typed_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            parts = {layer.qkv: [f"{attn}{p}_proj" for p in "qkv"], layer.o: [f"{attn}o_proj"],
                     layer.gate_up: [f"{mlp}gate_proj", f"{mlp}up_proj"], layer.down: [f"{mlp}down_proj"]}
            for linear, names in parts.items():
                linear.pack_int4(built.product([matrices[f"{name}.weight"] for name in names]), ALL_ROWS)
        embeddings = matrices["model.embed_tokens.weight"]
        self.lm_head.pack_int4(built.product([matrices.get("lm_head.weight", embeddings)]), ALL_ROWS)
        self._embedding = functools.partial(built.rows, embeddings)
        self._layer_step_known = False

    def prepack(self) -> None:
        """Lay the dense weights out for the CPU's matrix library (``linear.can_prepack``): layers for
        prompt chunks and batches, the output layer for a few rows at a time."""
        for layer in self.typed_layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                linear.prepack(PREFILL_ROWS)
        self.lm_head.prepack(1)

    def pack_int4(self, exact: dict[str, Tensor], rows: int, lossless_only: bool, merge_rows: int = 0) -> bool:
        """Give the layers 4-bit copies of their weights for products of at most ``rows`` rows, from
        ``exact`` (the model's float32 weights by name); with ``lossless_only``, only if every weight
        already is on a 4-bit grid per group (a model from a Q4 GGUF); a dense product of prompt rows
        takes up to ``merge_rows`` decoding rows along (``Linear.forward``). The output layer is packed
        on its own (``OutputLayer.pack``). Returns whether the layers were packed."""
        sources = []
        for i, layer in enumerate(self.typed_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            sources += [
                (layer.qkv, torch.cat([exact[f"{attn}{p}_proj.weight"] for p in "qkv"])),
                (layer.o, exact[f"{attn}o_proj.weight"]),
                (layer.gate_up, torch.cat([exact[f"{mlp}{p}_proj.weight"] for p in ("gate", "up")])),
                (layer.down, exact[f"{mlp}down_proj.weight"]),
            ]
        native = self._kernels if self._kernels is not None and self._kernels.products_run_here() else None
        self.output.pack(exact.get("lm_head.weight", exact["model.embed_tokens.weight"]), rows, lossless_only,
                         native is not None)
        if any(source.shape[1] % GROUP for _, source in sources):
            return False
        packs: list[tuple[Linear, NativeProduct | tuple[Tensor, Tensor]]] = []
        for linear, source in sources:  # all checked before any is packed: off the grid, all stay dense
            groups = Groups4.of(source)
            if lossless_only and not groups.exact(source):
                return False
            # kernels.c's copy where it runs the products, else torch's (never both: memory and time)
            packs.append((linear, groups.for_torch() if native is None else native.int4_weights(source, groups)))
        for linear, packed in packs:
            linear.pack_int4(packed, rows, merge_rows)
        self._layer_step_known = False
        return True

    @property
    def vocab(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def step_bytes(self, positions: int) -> int:
        """Bytes a one-row decoding step at ``positions`` reads: the weights its products run on (4-bit
        or 8-bit groups where packed), its norms, and the keys and values of ``positions`` positions.
        Where a step is bound by memory, what its time follows
        (docs/performance.md, "What a decoding step reads")."""
        weights = self.output.decoding_bytes + self.norm.nbytes
        for layer in self.typed_layers:
            weights += layer.input_norm.nbytes + layer.post_norm.nbytes
            weights += sum(linear.decoding_bytes for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
            weights += sum(norm.nbytes for norm in (layer.q_norm, layer.k_norm) if norm is not None)
        return weights + positions * self.cache.position_bytes

    def release(self, slot: int) -> None:
        pass  # nothing to free: the next sequence in the slot overwrites what it uses

    @property
    def keeps_prefixes(self) -> bool:
        return True  # a released slot's keys and values stay until a new sequence writes over them

    @property
    def one_call_rows(self) -> int:
        layer_step = self._one_call()
        return 0 if layer_step is None else layer_step.cheapest_rows

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        self.cache.copy_prefix(source, target, length)

    # --- a step -------------------------------------------------------------------------------------

    def run(self, plan: StepPlan, fed: Tensor | None = None) -> Tensor:
        rows = self._rows(plan)
        tokens, positions, slots = self._inputs(plan, rows)
        rows_wanted = self._outputs(plan, rows)
        limits, length = self._limits(plan, rows)
        fed_rows = rows_wanted[:len(plan.feeds)]  # the decoding rows
        if self._graphs is not None and rows and not plan.chunks:
            # the step's tokens are chosen from the logits before the next replay overwrites them
            return self._graphs.run(np.stack([tokens, positions, slots, limits]), length, rows_wanted,
                                    None if fed is None else (fed_rows, fed))
        wanted = self._on_device(rows_wanted)
        tokens_, positions_, slots_ = (self._on_device(array) for array in (tokens, positions, slots))
        if fed is not None:
            tokens_.index_copy_(0, self._on_device(fed_rows), fed)
        if self.compiled and rows and not plan.chunks:
            # the output layer inside the compiled step, for every row: as cheap as for some
            every_row: Tensor = self._decode(tokens_, positions_, slots_, self._mask(limits, length))
            return every_row[wanted]
        # rows that all attend to every column of the step (one stream) need no mask
        mask = None if (limits >= length - 1).all() else self._mask(limits, length)
        segments = tuple((chunk.slot, chunk.start, chunk.end) for chunk in plan.chunks)
        kernel = self._kernel_rows(plan, rows)
        hidden = self.forward(tokens_, positions_, slots_, (rows, length, mask), segments, kernel,
                              (positions, slots) if self._rope_store is not None else None)
        return self.output(norm(hidden[wanted], self.norm, self.eps, self._native_norm), decoding=len(plan.feeds))

    def logits(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        """A decoding-only step's logits of every row (the step that is compiled)."""
        hidden = self.forward(tokens, positions, slots, (mask.shape[0], mask.shape[-1], mask), ())
        return self.output(norm(hidden, self.norm, self.eps, self._native_norm), decoding=0)

    def _inputs(self, plan: StepPlan, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token, position and slot of each of the step's rows: the decoding rows (dummies at the
        scratch position), then the chunks' tokens."""
        tokens = np.zeros(rows, dtype=np.int64)
        positions = np.full(rows, self.cache.positions - 1, dtype=np.int64)
        for feed in plan.feeds:
            tokens[feed.slot], positions[feed.slot] = feed.token, feed.position
        chunks = plan.chunks
        return (np.concatenate([tokens, *(np.asarray(c.tokens, dtype=np.int64) for c in chunks)]),
                np.concatenate([positions, *(np.arange(c.start, c.end) for c in chunks)]),
                np.concatenate([np.arange(rows), *(np.full(len(c.tokens), c.slot) for c in chunks)]))

    def _outputs(self, plan: StepPlan, rows: int) -> np.ndarray:
        """The rows whose logits the plan wants: each feed's, then each last chunk's last token."""
        wanted = [feed.slot for feed in plan.feeds]
        offset = rows
        for chunk in plan.chunks:
            offset += len(chunk.tokens)
            if chunk.last:
                wanted.append(offset - 1)
        return np.asarray(wanted, dtype=np.int64)

    def _rows(self, plan: StepPlan) -> int:
        if not plan.feeds:
            return 0
        used = max(feed.slot for feed in plan.feeds) + 1
        if self.compiled and not plan.chunks:
            # a compiled step has one graph for every batch size from two up (torch specialises
            # size one): a lone sequence runs beside a dummy row rather than compile twice
            used = max(used, min(2, self.slots))
            if self.graphs:  # one CUDA graph per batch-size bucket: powers of two
                used = min(self.slots, 1 << (used - 1).bit_length())
        return used

    def _limits(self, plan: StepPlan, rows: int) -> tuple[np.ndarray, int]:
        """The last column each decoding row attends to (dummies: all), and how many columns the
        step's attention reads (with CUDA graphs, rounded up to a block)."""
        limits = np.full(rows, self.cache.positions - 1, dtype=np.int64)
        for feed in plan.feeds:
            limits[feed.slot] = feed.position
        length = max((feed.position for feed in plan.feeds), default=0) + 1
        if self.graphs:
            length = min(self.cache.positions, -(-length // ATTENTION_BLOCK) * ATTENTION_BLOCK)
        return limits, length

    def _mask(self, limits: np.ndarray, length: int) -> Tensor:
        """``[rows, 1, 1, length]``: the columns each decoding row attends to."""
        return (self.columns[:length][None, :] <= self._on_device(limits)[:, None])[:, None, None, :]

    def _kernel_rows(self, plan: StepPlan, rows: int) -> KernelRows | None:
        """The step's rows that attend through ``self.attention``, all of them: the decoding rows (each
        to its position; a dummy row, whose output is dropped, to nothing: under torch's mask it read
        as many columns as the longest row), then every chunk's tokens (the kernel attends a chunk's
        rows as blocks, faster than torch's attention at every chunk size:
        docs/performance.md, "CPU kernels"); None where the kernel is not used."""
        if self.attention is None or not (rows or plan.chunks):
            return None
        decoding = np.full(rows, -1, dtype=np.int64)
        for feed in plan.feeds:
            decoding[feed.slot] = feed.position
        slots, lasts = [np.arange(rows)], [decoding]
        for chunk in plan.chunks:
            slots.append(np.full(len(chunk.tokens), chunk.slot))
            lasts.append(np.arange(chunk.start, chunk.end))
        return np.concatenate(slots), np.concatenate(lasts)

    def _on_device(self, array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, decoding: Decoding,
                segments: tuple[tuple[int, int, int], ...], kernel: KernelRows | None = None,
                stored: KernelRows | None = None) -> Tensor:
        """Hidden states ``[N, hidden]`` (before the final norm) of a step's tokens: first one per
        decoding row (row b is slot b; ``decoding``: how many rows, how many columns they attend to
        and the mask of those, ``_mask``, or None for all), then the chunks (``segments``: slot,
        start, end). ``stored``: the rows' positions and slots, where ``kernels.c`` rotates and writes
        the cache (``_rope_store``)."""
        x = functional.embedding(tokens, self.embed).float() if self._embedding is None else self._embedding(tokens)
        bound = None if kernel is None or self.attention is None else self.attention.rows(*kernel)
        layer_step = self._one_call()
        if stored is not None and layer_step is not None and layer_step.takes(x.shape[0], bound) \
                and not torch.compiler.is_compiling():
            assert bound is not None
            return layer_step(x, stored, bound)
        store = None
        if stored is not None and self._rope_store is not None and not torch.compiler.is_compiling():
            store = functools.partial(self._rope_store, rows=stored)
        else:
            cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        for i, layer in enumerate(self.typed_layers):
            keys, values = self.cache.layer(i)
            if store is not None:
                q = layer.project_stored(x, decoding[0], functools.partial(store, keys=keys, values=values))
            else:
                q, k, v = layer.project(x, self.shape, cos, sin, decoding[0])
                keys[slots, :, positions] = k.to(keys.dtype)
                values[slots, :, positions] = v.to(values.dtype)
            following = self.cache.layer(i + 1) if i + 1 < len(self.typed_layers) else None
            x = layer.finish(x, self._attend(q, keys, values, decoding, segments, bound, following), decoding[0])
        return x

    def _one_call(self) -> LayerStep | None:
        """The layers in one ``kernels.c`` call (``workers.model.cpu.layerstep``), where they all run there."""
        if not self._layer_step_known:
            self._layer_step, self._layer_step_known = self._layer_step_of(), True
        return self._layer_step

    def _layer_step_of(self) -> LayerStep | None:
        """The layers in one call where every part of them runs through ``kernels.c`` (norms, rotation,
        attention, activation, and four 4-bit products without biases a layer) or ``blocks.c`` (the four
        products on a GGUF file's blocks); else None."""
        built, layers = self._kernels, self.typed_layers
        keys = self.cache.layer(0)[0]
        if built is None or self.attention is None or self._rope_store is None or self._rope_f32 is None \
                or not layers or keys.dtype not in FUNCTIONS \
                or self.embed.dtype not in (torch.float32, keys.dtype):  # the attention's rounding: the model's
            return None
        parts = []
        for i, layer in enumerate(layers):
            if layer.native_norm is None or layer.native_activation is None or layer.q_norm is not None:
                return None
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            four = [native for linear in linears if linear.bias is None
                    and (isinstance(native := linear.native, BlockProduct)
                         or (isinstance(native, kernels.GroupedWeights) and native.bits == 4))]
            if len(four) != len(linears) or len({type(product) for product in four}) != 1:  # one kind a layer
                return None
            parts.append(LayerParts(layer.input_norm, layer.post_norm, four, *self.cache.layer(i)))
        rows = min(min(linear.int4_rows, _rows_on_blocks(linear.native)) for layer in layers
                   for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return LayerStep(built, parts, self.shape[0], self.eps, self._rope_f32, rows) if rows else None

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, decoding: Decoding,
                segments: tuple[tuple[int, int, int], ...], kernel: StepRows | None,
                following: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Attention of the step's rows: the first ones through the kernel (``_kernel_rows``) where it
        takes them (``following``: the next layer's cache, which its helper thread reads ahead), the
        rest through torch (the decoding rows as one batch, each chunk on its own). Queries are taken
        in the cache's dtype; the result is in the model's."""
        _, kv_heads, head_dim = self.shape
        q = q.to(keys.dtype)
        parts = []
        rows, length, mask = decoding
        done = 0  # rows attended so far
        if kernel is not None and kernel.takes(q[:kernel.count], keys):
            done = kernel.count
            parts.append(kernel(q[:done], keys, values, following))
        elif rows:
            # the queries that share a key head attend as one block: no repeated keys
            grouped = q[:rows].view(rows, kv_heads, self.group, head_dim)
            parts.append(functional.scaled_dot_product_attention(
                grouped, keys[:rows, :, :length], values[:rows, :, :length], attn_mask=mask).flatten(1))
            done = rows
        offset = rows
        for slot, start, end in segments:
            count = end - start
            if offset >= done:
                parts.append(self._attend_chunk(q[offset:offset + count], keys, values, slot, start, end))
            offset += count
        attended = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attended.to(self.embed.dtype)

    def _attend_chunk(self, q: Tensor, keys: Tensor, values: Tensor, slot: int, start: int, end: int) -> Tensor:
        """Torch's attention of one prompt chunk (positions ``start..end-1`` of ``slot``), causal."""
        chunk = q.transpose(0, 1)[None]  # [1, heads, count, head_dim]
        causal = None if start == 0 else self.columns[:end][None, :] <= self.columns[start:end][:, None]
        attended = functional.scaled_dot_product_attention(
            chunk, keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end],
            attn_mask=causal, is_causal=causal is None, enable_gqa=True)
        return attended[0].transpose(0, 1).flatten(1)


def _rows_on_blocks(product: NativeProduct | None) -> int:
    """The most rows ``product`` takes on a GGUF file's blocks where it is such a product."""
    return product.rows_on_blocks if isinstance(product, BlockProduct) else ALL_ROWS
