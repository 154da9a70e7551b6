"""Per-format encode/decode pairs: the one definition of how a QTensor is laid out in each format's tensors.

Each module holds an `encode(qt, ...) -> {key: tensor}` (keys relative to the Linear's name, as written) and a
`decode(tensors, scheme, ...) -> QTensor` over a mapping of the same keys (a reader's lazy view of what is stored).
The writer writes what encode returns and the reader hands decode what it read, so the two cannot drift apart;
tests/export/test_codecs.py checks decode(encode(qt)) == qt for every format and scheme.

    ct.py       compressed-tensors: each number format's own layout (qtk.quant.formats) (--target vllm)
    gptq.py     legacy GPTQ: qweight / qzeros / scales / g_idx                       (--target gptq)
    awq.py      legacy AWQ GEMM: interleaved qweight / qzeros, scales                (--target awq)
    trtllm.py   TensorRT-LLM per quant_algo, with each tensor's sharding axes         (--target trtllm)
    modelopt.py ModelOpt unified HF: FP8, W4A16_AWQ                                  (--target hf-modelopt)
"""
