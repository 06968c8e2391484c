"""The interface between a linear layer (layers/linear.py) and the format of its weight."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.quantization.codes import QuantWeight


class LinearMethodBase:
    """How one linear layer holds its weight and multiplies by it, chosen when the layer is built
    (QuantizationConfig.get_quant_method). The layer owns the shapes and the tensor-parallel
    slicing; its method owns the tensors: create_weights at build, load_weight as each slice of
    the checkpoint arrives, process_weights_after_loading once everything is in, apply per call.
    """

    # The checkpoint's own codes (a GGUF's blocks) are given to load_weight instead of floats.
    takes_codes = False

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """The layer's weight for its partition (output_size_per_partition rows of
        input_size_per_partition columns), as a parameter named `weight` whose weight_loader
        is the layer's."""
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantWeight, row: int) -> None:
        """Write rows row.. of this rank's weight from this rank's slice of a checkpoint tensor
        (float in any dtype, rounded to the model's; or codes when takes_codes)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every slice is loaded (the fused decoder is built after this)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bytes_read(self, layer: nn.Module, num_rows: int) -> int:
        """Weight bytes a call with num_rows rows of input reads (the roofline of bench step)."""
        raise NotImplementedError
