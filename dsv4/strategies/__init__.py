"""Strategy options, one folder per group and one module per option (configs/<group>/ names them); the
Protocols in protocols.py, an option of each group together in choice.py (`Strategies`). The classes are
importable from here, where the YAML files' `_target_` names them."""
from dsv4.strategies.cache_layout.fp8_ds_mla import Fp8DsMlaLayout
from dsv4.strategies.cache_layout.fp8_ds_mla_fnuz import Fp8DsMlaFnuzLayout
from dsv4.strategies.cache_layout.fp8_per_tensor import Fp8PerTensorLayout
from dsv4.strategies.cache_layout.plain import PlainRowLayout
from dsv4.strategies.head_padding.buckets import BucketHeadPadding
from dsv4.strategies.head_padding.none import NoHeadPadding
from dsv4.strategies.indexer.deepgemm_fp8 import DeepGemmFp8Indexer
from dsv4.strategies.indexer.exact import ExactIndexer
from dsv4.strategies.indexer.fp4_sim import Fp4SimIndexer
from dsv4.strategies.indexer.key_layouts import Fp8KeyLayout, Mxfp4KeyLayout
from dsv4.strategies.indexer.mxfp4 import Mxfp4Indexer
from dsv4.strategies.indexer.top_k.flashinfer import FlashInferTopK
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.indexer.triton_fp8 import TritonFp8Indexer
from dsv4.strategies.linear.deepgemm_fp8 import DeepGemmFp8Linear
from dsv4.strategies.linear.deepgemm_triton_fp8 import DeepGemmTritonFp8Linear
from dsv4.strategies.linear.fp8_sim import Fp8SimLinear
from dsv4.strategies.linear.reference import ReferenceLinear
from dsv4.strategies.linear.torch_fp8 import TorchFp8Linear
from dsv4.strategies.linear.triton_fp8 import TritonFp8Linear
from dsv4.strategies.mqa_kernel.aiter_sparse import AiterSparseMQA
from dsv4.strategies.mqa_kernel.flashinfer_sparse import FlashInferSparse
from dsv4.strategies.mqa_kernel.flashmla_sparse import FlashMLASparse
from dsv4.strategies.mqa_kernel.reference import ReferenceMQA
from dsv4.strategies.mqa_kernel.triton_sparse import TritonSparseMQA
from dsv4.strategies.o_proj.deepgemm_fp8 import DeepGemmFp8OProj
from dsv4.strategies.o_proj.reference import ReferenceOProj
from dsv4.strategies.o_proj.rocm_bf16 import RocmBf16OProj
from dsv4.strategies.o_proj.torch_fp8 import TorchFp8OProj
from dsv4.strategies.o_proj.triton_fp8 import TritonFp8OProj
from dsv4.values.seam import SparseKV
from dsv4.strategies.choice import Strategies
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, IndexerStrategy, LinearStrategy, LinearWeight,
                                       MQAKernelStrategy, Needs, OProjStrategy, OProjWeights, TopKStrategy)

__all__ = ["AiterSparseMQA", "BucketHeadPadding", "CacheLayout", "DeepGemmFp8Indexer", "DeepGemmFp8Linear",
           "DeepGemmFp8OProj", "DeepGemmTritonFp8Linear", "ExactIndexer", "FlashInferSparse", "FlashInferTopK",
           "FlashMLASparse", "Fp4SimIndexer", "Fp8DsMlaFnuzLayout", "Fp8DsMlaLayout", "Fp8KeyLayout",
           "Fp8PerTensorLayout", "Fp8SimLinear",
           "HeadPaddingPolicy", "IndexerStrategy", "LinearStrategy", "LinearWeight", "MQAKernelStrategy",
           "Mxfp4Indexer", "Mxfp4KeyLayout", "Needs", "NoHeadPadding", "OProjStrategy", "OProjWeights",
           "PlainRowLayout", "ReferenceLinear", "ReferenceMQA", "ReferenceOProj", "RocmBf16OProj", "SparseKV",
           "Strategies", "TopKStrategy", "TorchFp8Linear", "TorchFp8OProj", "TritonFp8Indexer", "TritonFp8Linear",
           "TritonFp8OProj", "TritonSparseMQA", "TritonTopK", "indexer_keys_layout"]


def indexer_keys_layout(indexer: IndexerStrategy | None, *, dtype: str, head_dim: int) -> CacheLayout:
    """How `indexer` stores its keys for activations of `dtype`: its record layout, or plain rows in that
    dtype where it keeps no record of its own (its `key_layout` gives None, or no indexer is named)."""
    keys = None if indexer is None else indexer.key_layout(dtype=dtype, head_dim=head_dim)
    return keys or PlainRowLayout(name=dtype, dtype=dtype)
