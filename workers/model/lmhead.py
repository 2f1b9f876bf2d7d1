"""The decoder's output layer (``workers.model.decoder``): its logits on dense weights, or on packed ones
(4-bit groups, or 8-bit groups through torch's 4-bit kernel twice or ``kernels.c``), with each row's
highest logits computed again on the exact weights."""

import torch
from torch import Tensor

from workers.model.cpu import kernels
from workers.model.cpu.groups import GROUP, Groups4, Groups8
from workers.model.linear import Linear

REFINED = 16  # logits of each row computed again on the dense weights where the output layer is packed


class OutputLayer:
    """``linear``'s logits (the decoder's ``lm_head``), packed by ``pack``."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.kernels: kernels.Kernels | None = None  # the decoder's (``Decoder.use_kernels``)
        # the exact weights where the dense copy is rounded (a bfloat16 model): the 8-bit codes and
        # their scales, or the float32 weights (``exact_rows``)
        self._exact: tuple[Tensor, Tensor | None] | None = None
        self._codes: tuple[Tensor, Tensor] | None = None  # the 8-bit codes and scales
        self._int8: kernels.GroupedWeights | None = None  # the same for kernels.c (``_int8_logits``)
        self._packed = False  # on 4-bit or 8-bit groups (``pack``)

    @property
    def vocab(self) -> int:
        return int(self.linear.weight.shape[0])

    @property
    def packing(self) -> str:
        """What one row's logits run on, in words."""
        return "8-bit groups through kernels.c" if self._through_kernels() else self.linear.packing

    @property
    def decoding_bytes(self) -> int:
        """Bytes one row's logits read from the weights: the 8-bit codes ``kernels.c`` multiplies (with
        float16 scales, as it holds them), else the linear's (the refined rows' few aside)."""
        if not self._through_kernels():
            return self.linear.decoding_bytes
        if self._int8 is not None:
            return self._int8.nbytes
        assert self._codes is not None
        codes, scales = self._codes
        return codes.nbytes + 2 * scales.numel()

    def _through_kernels(self) -> bool:
        """Whether a few rows' logits come from the 8-bit codes through ``kernels.c`` (``_int8_logits``)."""
        return self.kernels is not None and (self._codes is not None or self._int8 is not None) \
            and self.kernels.products_run_here()

    def pack(self, source: Tensor, rows: int, lossless_only: bool, native: bool) -> None:
        """The output layer on 4-bit or 8-bit groups, whichever holds its weights exactly (GGUF models
        mostly keep it in Q8_0); without ``lossless_only``, on 8-bit groups. An 8-bit product costs
        two 4-bit ones, so it pays up to half as many rows. With ``native``, 8-bit groups are kept as
        codes for ``kernels.c`` alone (``_int8_logits``), not packed for torch's kernel too."""
        if source.shape[1] % GROUP:
            return
        # where the dense copy is rounded (a bfloat16 model), the refinement reads the exact weights:
        # the 8-bit codes where they hold them, else the float32 weights themselves
        exact: tuple[Tensor, Tensor | None] = (source, None)
        four = Groups4.of(source)
        if four.exact(source):
            self.linear.pack_int4(four.for_torch(), rows)
        else:
            on_grid = (eight := Groups8.of(source)).exact(source)
            if lossless_only and not on_grid:
                return
            self.linear.pack_int8(max(1, rows // 2), None if native else eight)
            self._codes = eight.codes()
            exact = self._codes if on_grid else exact
        self._packed = True
        if self.linear.weight.dtype != torch.float32:
            self._exact = exact

    def __call__(self, hidden: Tensor, decoding: int) -> Tensor:
        """Logits of the normed hidden states (``decoding``: how many of the first rows are decoding
        rows). On packed output weights (``pack``) the products are rounded to bfloat16, which
        put greedy text off the float32 model's where two candidates are close; so the ``REFINED``
        highest logits of each row are computed again on the dense weights: the greedy choice is the
        dense model's unless more than that many tokens are within the rounding (about 2**-8 of the
        logits) of the best (docs/performance.md, "The output layer")."""
        if not hidden.shape[0]:  # a step of prompt chunks none of which ends its prompt
            return hidden.new_empty((0, self.vocab), dtype=torch.float32)
        logits = self._int8_logits(hidden)
        if logits is None:
            # in float32 where a kernel gives it so (a bfloat16 model on blocks), else the weights' dtype
            product: Tensor = self.linear(hidden, decoding, cast=False)
            if not self._packed:
                return product
            logits = product.float()
        top = self._highest(logits)
        exact = torch.matmul(self.exact_rows(top), hidden.float()[:, :, None])
        return logits.scatter_(-1, top, exact[..., 0])

    def _highest(self, logits: Tensor) -> Tensor:
        """Where the ``REFINED`` highest logits of each row are: through ``kernels.c`` on a CPU (one scan,
        far cheaper than torch's ``topk``: docs/performance.md, "The output layer"), else torch's."""
        built = self.kernels
        if built is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 \
                and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] >= REFINED \
                and not torch.compiler.is_compiling():
            return built.top_k(logits, REFINED)
        return logits.topk(REFINED, dim=-1, sorted=False).indices

    def _int8_logits(self, hidden: Tensor) -> Tensor | None:
        """The output layer's logits from its 8-bit codes through ``kernels.c`` (inputs quantised to 8 bits
        per 32: about as close as the 4-bit kernel's bfloat16 inputs, refined the same way), where it beats
        the 4-bit kernel run twice (AVX2 or AVX512-VNNI, one thread, as few rows as that takes); else None."""
        built, codes = self.kernels, self._codes
        if not self._through_kernels() or torch.compiler.is_compiling() or hidden.shape[0] > self.linear.int4_rows:
            return None
        assert built is not None
        if codes is not None:  # kernels.c keeps a copy of its own (in blocks): this one goes
            self._int8, self._codes = built.int8_weights(*codes), None
        assert self._int8 is not None
        return self._int8(hidden)

    def exact_rows(self, top: Tensor) -> Tensor:
        """The output layer's weights of the rows ``top`` in float32, exactly as the model holds them
        (a bfloat16 copy would round the refined logits again)."""
        if self._exact is None:
            return self.linear.weight[top].float()
        weights, scales = self._exact
        if scales is None:
            return weights[top]
        codes = weights[top].view(*top.shape, -1, GROUP).float()
        rows: Tensor = (codes * scales[top][..., None]).flatten(-2)
        return rows
