"""Strategy options. One class per option family; the YAML under configs/<group>/ picks and names it."""
from dsv4.strategies.aiter import AiterSparseMQA, RocmBf16OProj
from dsv4.strategies.cache_layout import PlainRowLayout
from dsv4.strategies.flashinfer import FlashInferSparse
from dsv4.strategies.flashmla import FlashMLASparse
from dsv4.strategies.fp8_fnuz import Fp8DsMlaFnuzLayout
from dsv4.strategies.fp8_keys import DeepGemmFp8Indexer, Fp8KeyLayout, TritonFp8Indexer
from dsv4.strategies.fp8_layouts import Fp8DsMlaLayout, Fp8PerTensorLayout
from dsv4.strategies.fp8_oproj import DeepGemmFp8OProj, TorchFp8OProj, TritonFp8OProj
from dsv4.strategies.head_padding import BucketHeadPadding, NoHeadPadding
from dsv4.strategies.indexer import ExactIndexer, Fp4SimIndexer
from dsv4.strategies.mqa_kernel import ReferenceMQA
from dsv4.strategies.mxfp4 import Mxfp4Indexer, Mxfp4KeyLayout
from dsv4.strategies.o_proj import ReferenceOProj
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, IndexerStrategy, MQAKernelStrategy, Needs,
                                       OProjStrategy, OProjWeights, SparseKV)
from dsv4.strategies.triton_sparse import TritonSparseMQA

__all__ = ["AiterSparseMQA", "BucketHeadPadding", "CacheLayout", "DeepGemmFp8Indexer", "DeepGemmFp8OProj",
           "ExactIndexer", "FlashInferSparse", "FlashMLASparse", "Fp4SimIndexer", "Fp8DsMlaFnuzLayout",
           "Fp8DsMlaLayout", "Fp8KeyLayout", "Fp8PerTensorLayout", "HeadPaddingPolicy", "IndexerStrategy",
           "MQAKernelStrategy", "Mxfp4Indexer", "Mxfp4KeyLayout", "Needs", "NoHeadPadding", "OProjStrategy",
           "OProjWeights", "PlainRowLayout", "ReferenceMQA", "ReferenceOProj", "RocmBf16OProj", "SparseKV",
           "TorchFp8OProj", "TritonFp8Indexer", "TritonFp8OProj", "TritonSparseMQA"]
