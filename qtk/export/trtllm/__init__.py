"""TensorRT-LLM target: a `trtllm-build` checkpoint (config.json + rank{N}.safetensors, docs/formats.md, trtllm).

    algo.py      which quant_algo each scheme is (MIXED_PRECISION + quant_cfg.json for mixed weight-only recipes)
    sharding.py  which --tp/--pp a model allows, and how each module's tensors split over ranks
    writer.py    LayerResults -> TensorRT-LLM names, encoded (qtk.export.codecs.trtllm), sharded, streamed per rank
    reader.py    a checkpoint read back in Hugging Face names, decoded as the engine decodes it

Layouts follow what NVIDIA ModelOpt exports for the same scheme (tests/trtllm pins them against a ModelOpt-written
reference).
"""

from qtk.export.trtllm.algo import TRTQuant, trtllm_quant
from qtk.export.trtllm.reader import TRTLLMCheckpoint
from qtk.export.trtllm.writer import TRTLLMWriter

__all__ = ["TRTLLMCheckpoint", "TRTLLMWriter", "TRTQuant", "trtllm_quant"]
