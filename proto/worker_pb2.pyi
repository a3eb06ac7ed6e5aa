from pdserve.proto import pdserve_pb2 as _pdserve_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResolvedSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "return_logprobs", "num_top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "return_prompt_logprobs", "num_top_prompt_logprobs", "structured_output", "min_p", "bad_words", "allowed_token_ids", "priority", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    return_logprobs: bool
    num_top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    return_prompt_logprobs: bool
    num_top_prompt_logprobs: int
    structured_output: _pdserve_pb2.StructuredOutput
    min_p: float
    bad_words: _containers.RepeatedCompositeFieldContainer[_pdserve_pb2.TokenIds]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., num_top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., return_prompt_logprobs: _Optional[bool] = ..., num_top_prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_pdserve_pb2.StructuredOutput, _Mapping]] = ..., min_p: _Optional[float] = ..., bad_words: _Optional[_Iterable[_Union[_pdserve_pb2.TokenIds, _Mapping]]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "dst_kv_address", "dst_block_ids", "first_output_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DST_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    dst_kv_address: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_output_index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., dst_kv_address: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., first_output_index: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "queue_s", "prefill_s", "transfer_s", "num_kv_bytes", "transfer_tail_s", "num_cached_tokens", "first_logprobs", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    num_kv_bytes: int
    transfer_tail_s: float
    num_cached_tokens: int
    first_logprobs: TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, first_token: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., num_kv_bytes: _Optional[int] = ..., transfer_tail_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_timeout_s", "local_prefill", "prior_output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    kv_timeout_s: float
    local_prefill: bool
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., kv_timeout_s: _Optional[float] = ..., local_prefill: _Optional[bool] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Allocated(_message.Message):
    __slots__ = ("block_ids", "kv_address", "num_free_blocks", "pool_version")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_address: str
    num_free_blocks: int
    pool_version: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., kv_address: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., pool_version: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("finish_reason", "num_output_tokens", "kv_wait_s", "num_draft_tokens", "num_accepted_tokens", "num_free_blocks", "pool_version")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _pdserve_pb2.FinishReason
    num_output_tokens: int
    kv_wait_s: float
    num_draft_tokens: int
    num_accepted_tokens: int
    num_free_blocks: int
    pool_version: int
    def __init__(self, finish_reason: _Optional[_Union[_pdserve_pb2.FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ..., kv_wait_s: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., pool_version: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("allocated", "tokens", "finished")
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    allocated: Allocated
    tokens: TokenDelta
    finished: DecodeFinished
    def __init__(self, allocated: _Optional[_Union[Allocated, _Mapping]] = ..., tokens: _Optional[_Union[TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...
