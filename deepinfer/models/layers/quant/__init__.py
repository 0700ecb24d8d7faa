"""How the model's linears are quantized at load: the settings a load runs under (settings.py) and the
checkpoint formats' entry in the loader (int4 records, deepinfer.models.loader). docs/quantization.md."""

from deepinfer.models.layers.quant.settings import (
    LinearQuantSettings,
    active_linear_quant,
    fused_act_quant,
    use_linear_quant,
)

__all__ = ["LinearQuantSettings", "active_linear_quant", "fused_act_quant", "use_linear_quant"]
