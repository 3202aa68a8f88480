"""The HF sampler's decode step with the Llama-family layer (Llama, SmolLM, Qwen2, Qwen3, Mistral without a sliding
window) written out over key / value buffers allocated ahead: the same operations in the same order as the model's
forward, so the same logits, with less per-step overhead on a CPU (docs/performance.md 2.4), and replayed from CUDA
graphs on a GPU (`GraphStep`, one set a run: `GraphSteps`). The interface is lib.sampling.rollout.ModelStep's (`keep(rows)`,
`step(tokens, positions) -> (B, V) float32 logits`); lib/sampling/cpu_kernels.prepack_for_cpu hands it to
lib.sampling.rollout.HFRollout for a Llama-family copy (`decode_step_for`). Other families (Gemma, Phi-3, sliding windows)
decode with the model's own forward (docs/models.md 1).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from lib.models.modeling import FAST_ATTENTION, OutputHead

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def llama_family(lm: torch.nn.Module) -> bool:
    """Whether `LlamaStep` computes what this model's own forward does: a Llama-family decoder whose every layer
    attends to the whole context (no sliding window: a layer's own `sliding_window` where it keeps one, as Qwen2 and
    Qwen3 do, else the config's, as Mistral reads it), with the attention we register for CPUs or SDPA."""
    config = lm.config
    if config.model_type not in LLAMA_FAMILY or not hasattr(lm, "get_decoder"):
        return False
    layers = lm.get_decoder().layers
    window = getattr(config, "sliding_window", None)
    return all(getattr(layer.self_attn, "sliding_window", window) is None for layer in layers) and \
        config._attn_implementation in ("agrpo_sdpa", "sdpa")


def host_synced_rope(lm: torch.nn.Module) -> bool:
    """Whether the model's rotary embedding reads the positions back on the host at every call, which a CUDA graph
    cannot capture: "dynamic" NTK scaling and "longrope" (transformers' `dynamic_rope_update` compares max(position)
    + 1 with a Python number to decide whether to recompute or swap its frequencies). The other rope types ("default",
    "linear", "yarn", "llama3", ...) compute their frequencies once, at start."""
    rope_type = getattr(lm.get_decoder().rotary_emb, "rope_type", "default")
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]  # per layer kind where it varies
    return any("dynamic" in t or t == "longrope" for t in types)


def graphable(lm: torch.nn.Module) -> bool:
    """Whether `GraphStep` can capture this model's decode step: a Llama-family model (`llama_family`) whose rotary
    embedding stays on the device (`host_synced_rope`)."""
    return llama_family(lm) and not host_synced_rope(lm)


def _lora_linear(module: torch.nn.Module):
    """A PEFT LoRA layer's product without merging: the base layer's product (a bitsandbytes 4-bit base dequantises
    its weight for the call, one layer at a time) plus, for each active adapter, scale B (A x) (Hu et al. 2021, eq.
    3; scale = alpha / r, or alpha / sqrt(r) with rsLoRA: PEFT's `scaling`), x cast to the adapter's dtype as PEFT's
    forward casts it. Sampling runs in eval mode, where LoRA's dropout is the identity, so it is left out. A variant
    not written out here (DoRA and the like), or an adapter merged into its base, keeps PEFT's own forward. The
    adapter's weights are read at each call, so an optimizer step (in place) is seen without a sync."""
    names = [] if module.disable_adapters else [a for a in module.active_adapters if a in module.lora_A]
    if module.merged or any(a in getattr(module, "lora_variant", {}) for a in names):
        return module
    base = _linear(module.base_layer)
    adapters = [(module.lora_A[a], module.lora_B[a], module.scaling[a]) for a in names]

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        for lora_a, lora_b, scale in adapters:
            out = out + (lora_b(lora_a(x.to(lora_a.weight.dtype))) * scale).to(out.dtype)
        return out

    return forward


def _linear(module: torch.nn.Module):
    """A layer's product as a plain function of a 2-D x (a prepacked oneDNN layer's kernel called directly; a LoRA
    layer's base product plus its adapter's, `_lora_linear`)."""
    if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
        return _lora_linear(module)
    packed = getattr(module, "packed", None)
    if packed is None:
        return module
    bias = module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:  # x: (rows, in_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _products(*blocks: tuple[torch.nn.Module, ...]):
    """The products of layers that read one 2-D x, as a function x -> a tuple with one tensor a block of layers
    (their outputs side by side): one kernel call where the layers are, in order, the parts of one prepacked group
    (lib/sampling/cpu_kernels.PackedGroup: bit for bit the layers' own products), else one call a layer."""
    modules = [m for block in blocks for m in block]
    group = getattr(modules[0], "group", None)
    if group is not None and len(group.sizes) == len(modules) and \
            all(getattr(m, "group", None) is group and m.index == i for i, m in enumerate(modules)):
        sizes = [sum(m.out_features for m in block) for block in blocks]
        return lambda x: group.product(x).split(sizes, dim=-1)
    products = [[_linear(m) for m in block] for block in blocks]

    def forward(x: torch.Tensor) -> tuple:
        return tuple(fs[0](x) if len(fs) == 1 else torch.cat([f(x) for f in fs], dim=-1) for fs in products)

    return forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation (Zhang & Sennrich 2019) in transformers' order: statistics in float32, the
    result cast back before the gain. On a CPU torch's rms_norm without a gain computes exactly that (upcast,
    x * rsqrt(mean(x^2) + eps), cast back) in one call instead of seven; on a GPU it is a fused kernel of its own,
    which may sum in another order, so there the operations are spelled out as transformers writes them."""
    if x.device.type == "cpu":
        return weight * torch.nn.functional.rms_norm(x, x.shape[-1:], eps=eps)
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the half-split layout, x cos + rotate_half(x) sin, with
    rotate_half(x) sin = cat(-x2, x1) sin written as cat(x2, x1) cat(-sin1, sin2): x rolled by half a head, times
    the sine with its first half negated once a step (negation is exact, so the same numbers in two kernels fewer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, additive_mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """lib/sampling/cpu_kernels.grouped_decode_attention for one query a row, in four kernels where it takes nine,
    the same numbers: the mask given once a step as 0 / -inf and added with the scale (torch.add's alpha) in
    float32, which is its scores' float32 upcast, scaling and masked_fill bit for bit (x * s + 0 is x * s, x * s -
    inf is -inf). Grouped-query attention (Ainslie et al. 2023) without repeating the keys and values per query head:
    the G = heads / KV query heads that share a key/value head are the rows of one product with it, so each key and
    value is read once (transformers' SDPA with a mask repeats them G times first: 7x the bytes for Qwen2.5). The
    scores are the product's bf16 (in a bf16 model) upcast to float32, as transformers' eager attention computes them.
    q: (B, heads, 1, D); keys, values: (B, KV, L, D); additive_mask: (B, 1, 1, L) float32. Returns (B, heads * D)."""
    batch, heads, _, dim = q.shape
    grouped = q.view(batch, keys.shape[1], heads // keys.shape[1], dim)  # head h attends with kv head h // groups
    scores = torch.add(additive_mask, torch.matmul(grouped, keys.transpose(-1, -2)), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, heads * dim)


def _write(buffer: torch.Tensor, col, value: torch.Tensor) -> None:
    """buffer[:, :, col] = value for a (B, heads, 1, D) value: `col` a slice (a plain copy), or a (1,) device tensor
    (an index copy, which a CUDA graph can replay at the column the tensor holds then)."""
    if isinstance(col, slice):
        buffer[:, :, col] = value
    else:
        buffer.index_copy_(2, col, value)


class LlamaStep:
    """A Llama-family decode step over per-layer key/value buffers (B, KV heads, capacity, D), zero-filled, holding
    the prefill's keys and values, grown by doubling (one copy per doubling, not one per token) up to the prompt plus
    `max_new_tokens`. Attention reads each buffer whole: its unwritten positions are masked (probability exactly 0,
    times values that are exactly 0).

    Attention: on a CPU the model's own (`_grouped_attention`, our registered decode attention written out, or the
    function the model calls, so the logits are its forward's bit for bit); elsewhere always `_grouped_attention`,
    which reads grouped keys and values once (`grouped` forces either, for tests). `capacity`: the buffers' length
    from the start (default: the prompt plus `block`, grown as needed)."""

    def __init__(self, lm: torch.nn.Module, cache: DynamicCache, attention: torch.Tensor, max_new_tokens: int,
                 block: int = 128, capacity: int | None = None, grouped: bool | None = None):
        decoder = lm.get_decoder()
        self.embed, self.rotary, self.head = decoder.embed_tokens, decoder.rotary_emb, OutputHead(lm)
        self.final_norm = (decoder.norm.weight, decoder.norm.variance_epsilon)
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norms = None
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's query and key
                qk_norms = ((attn.q_norm.weight, attn.q_norm.variance_epsilon),
                            (attn.k_norm.weight, attn.k_norm.variance_epsilon))
            self.layers.append((
                (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                # q and k side by side (rotated together), v
                _products((attn.q_proj, attn.k_proj), (attn.v_proj,)), _linear(attn.o_proj), qk_norms, attn,
                (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                _products((mlp.gate_proj,), (mlp.up_proj,)), _linear(mlp.down_proj), mlp.act_fn))
        self.head_dim = self.layers[0][4].head_dim
        self.heads = lm.config.num_attention_heads
        # the function the model calls (transformers' registry lives with its model code, which the model loaded)
        from transformers import AttentionInterface

        self.attention = AttentionInterface()[lm.config._attn_implementation]
        # the CPU's decode attention (what the model calls there) written out here in fewer kernels; on a GPU the
        # model's SDPA would repeat each key/value head per query head inside the step (issue 52, defect 8)
        if grouped is None:
            grouped = lm.config._attn_implementation == FAST_ATTENTION or attention.device.type != "cpu"
        self.grouped = grouped
        prompt_len = attention.shape[1]
        self.limit = prompt_len + max_new_tokens
        capacity = capacity or min(self.limit, prompt_len + block)
        self.keys, self.values = [], []
        for layer in cache.layers:
            shape = (*layer.keys.shape[:2], capacity, layer.keys.shape[-1])
            keys = layer.keys.new_zeros(shape)
            values = layer.values.new_zeros(shape)
            keys[:, :, :prompt_len] = layer.keys
            values[:, :, :prompt_len] = layer.values
            self.keys.append(keys)
            self.values.append(values)
        cache.layers.clear()  # the prefill's tensors are copied: free them now
        self.mask = torch.zeros(attention.shape[0], capacity, dtype=torch.bool, device=attention.device)
        self.mask[:, :prompt_len] = attention.bool()
        self.length = prompt_len

    def keep(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask = self.mask[rows]

    def _grow(self) -> None:
        capacity = min(self.limit, 2 * self.mask.shape[1])

        def widen(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])
            out[:, :, : t.shape[2]] = t
            return out

        self.keys = [widen(k) for k in self.keys]
        self.values = [widen(v) for v in self.values]
        mask = self.mask.new_zeros(self.mask.shape[0], capacity)
        mask[:, : self.mask.shape[1]] = self.mask
        self.mask = mask

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.length == self.mask.shape[1]:
            self._grow()
        col = self.length
        self.length += 1
        self.mask[:, col] = True
        return self._forward(tokens, positions, slice(col, col + 1), self.mask.shape[1])

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, col, width: int) -> torch.Tensor:
        """One token a row through every layer: its key and value written at `col` (a slice, or a (1,) index tensor
        for `GraphStep`), attention over the buffers' first `width` positions (the mask says which count)."""
        mask = self.mask[:, None, None, :width]  # (B, 1, 1, width), True = attend
        if self.grouped:
            mask = torch.where(mask, 0.0, float("-inf"))  # once a step, not once a layer
        batch, dim, heads = tokens.shape[0], self.head_dim, self.heads
        hidden = self.embed(tokens)  # (B, H): one token a row, so no sequence axis
        cos, sin = self.rotary(hidden, positions[:, None])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, 1, D)
        signed_sin = torch.cat((-sin[..., : dim // 2], sin[..., dim // 2 :]), dim=-1)
        for i, (norm1, qkv_proj, o_proj, qk_norms, attn, norm2, gate_up, down, act) in enumerate(self.layers):
            x = _rms_norm(hidden, *norm1)
            qk, v = qkv_proj(x)
            qk = qk.view(batch, -1, 1, dim)  # (B, heads + KV heads, 1, D)
            if qk_norms is not None:
                qk = torch.cat((_rms_norm(qk[:, :heads], *qk_norms[0]), _rms_norm(qk[:, heads:], *qk_norms[1])), 1)
            qk = _rotate(qk, cos, signed_sin)  # the query and key heads rotated in one go
            q = qk[:, :heads]
            _write(self.keys[i], col, qk[:, heads:])
            _write(self.values[i], col, v.view(batch, -1, 1, dim))
            keys, values = self.keys[i][:, :, :width], self.values[i][:, :, :width]
            if self.grouped:
                out = _grouped_attention(q, keys, values, mask, attn.scaling)
            else:
                out = self.attention(attn, q, keys, values, mask, scaling=attn.scaling)[0].reshape(batch, -1)
            hidden = hidden + o_proj(out)
            x = _rms_norm(hidden, *norm2)
            gate, up = gate_up(x)
            hidden = hidden + down(act(gate) * up)
        return self.head(_rms_norm(hidden, *self.final_norm))


_SIDE_STREAMS: dict = {}  # device -> the stream GraphStep warms up on


class GraphStep(LlamaStep):
    """`LlamaStep` on CUDA, replayed from CUDA graphs: a decode step of a small model on a GPU is bound by launching
    its ~20 kernels a layer one by one from Python (40-80x its memory floor on an H100, docs/performance.md 6), and a
    graph launches them all at once. What a graph needs fixed is fixed: the buffers hold the prompt plus every new
    token from the start (no growth; their length rounded up to a multiple of `block`), the column written is a
    device tensor the graph advances itself, the tokens and positions go through static buffers, and rows that end
    stay in the batch (their outputs unread). Attention reads a window of the buffers, a multiple of `block`
    positions (one graph per window, captured when the first step needs it, that step run eagerly as the capture's
    warm-up), so a step's attention reads fewer than `block` positions more than the tokens so far. Same operations
    as `LlamaStep`, so the same logits (tests/test_gpu.py; on a CPU it runs its steps eagerly, tests/test_decode.py).

    The windows depend on the buffers' length only, not on the prompt, so one GraphStep serves every generate call
    whose batch and prompt plus new tokens fit (`fits`, then `restart`): the graphs are captured once a window a run
    (`GraphSteps`), not once a call. They read the model's weights where they are, so a sync that copies new weights
    into them (lib/sampling/policy_copy.SamplingCopy.sync) keeps them valid; `fits` refuses a model whose parameters
    or buffers were replaced by other tensors."""

    def __init__(self, lm: torch.nn.Module, cache: DynamicCache, attention: torch.Tensor, max_new_tokens: int,
                 block: int = 128):
        if attention.device.type == "cuda" and host_synced_rope(lm):
            raise ValueError(f"GraphStep: {type(lm).__name__}'s rope type "
                             f"({lm.get_decoder().rotary_emb.rope_type}) reads positions back on the host at every "
                             f"step, which a CUDA graph cannot capture; decode it with LlamaStep (decode_step_for "
                             f"chooses)")
        capacity = -(-(attention.shape[1] + max_new_tokens) // block) * block
        super().__init__(lm, cache, attention, max_new_tokens, capacity=capacity)
        # every multiple of block: once a run, a graph more costs one capture (tens of milliseconds), where a
        # window twice the tokens' would cost every step up to twice the keys' and values' bytes
        self.windows = list(range(block, capacity + 1, block))
        device = attention.device
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(attention.shape[0], dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.tokens)
        self.graphs: dict[int, tuple] = {}  # window -> (graph, its output buffer)
        self.pool = None
        self.captures = 0  # graphs captured so far (one a window, whatever the number of generate calls)
        self.model, self.weights = lm, _storage(lm)
        self._restart_rows(attention)

    def _restart_rows(self, attention: torch.Tensor) -> None:
        self.col.fill_(attention.shape[1])
        self.rows = torch.arange(attention.shape[0], device=attention.device)  # the live rows' places in the buffers

    def fits(self, lm: torch.nn.Module, attention: torch.Tensor, max_new_tokens: int) -> bool:
        """Whether this step (its buffers and graphs) can serve a generate call on `lm` with this (B, prompt) mask:
        the same model with its weights in the same tensors, the same rows, prompt plus new tokens within the
        buffers."""
        return lm is self.model and attention.shape[0] == self.mask.shape[0] and \
            attention.shape[1] + max_new_tokens <= self.mask.shape[1] and attention.device == self.mask.device and \
            _storage(lm) == self.weights

    def restart(self, cache: DynamicCache, attention: torch.Tensor, max_new_tokens: int) -> None:
        """Start a new generate call (`fits` said yes): the prefill's keys and values copied into the buffers, the
        rest zeroed and masked, all in place (the graphs read these tensors)."""
        prompt_len = attention.shape[1]
        for keys, values, layer in zip(self.keys, self.values, cache.layers):
            keys[:, :, :prompt_len] = layer.keys
            values[:, :, :prompt_len] = layer.values
            keys[:, :, prompt_len:] = 0  # not read (masked), but a stale NaN times probability 0 would still be NaN
            values[:, :, prompt_len:] = 0
        cache.layers.clear()
        self.mask.zero_()
        self.mask[:, :prompt_len] = attention.bool()
        self.limit, self.length = prompt_len + max_new_tokens, prompt_len
        self._restart_rows(attention)

    def keep(self, rows: torch.Tensor) -> None:
        self.rows = self.rows[rows]

    def _body(self, width: int) -> torch.Tensor:
        self.mask.index_fill_(1, self.col, True)
        logits = self._forward(self.tokens, self.positions, self.col, width)
        self.col += 1
        return logits

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.index_copy_(0, self.rows, tokens)
        self.positions.index_copy_(0, self.rows, positions)
        self.length += 1
        width = next(w for w in self.windows if w >= self.length)
        if self.col.device.type != "cuda":  # elsewhere (the GPU check's dry run, tests): the same steps, eagerly
            return self._body(width)[self.rows]
        if width in self.graphs:
            graph, out = self.graphs[width]
            graph.replay()
            return out[self.rows]
        # warm-up on a side stream (the capture's rule), which is this step; then capture the next steps' graph
        with torch.cuda.device(self.col.device):
            # one side stream a device for the whole run: each stream that runs a matrix product gets (and keeps)
            # its own cuBLAS workspace, and a new stream per capture would cycle through PyTorch's pool of 32
            stream = _SIDE_STREAMS.get(self.col.device) or _SIDE_STREAMS.setdefault(self.col.device,
                                                                                     torch.cuda.Stream())
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._body(width)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # the graphs may share one memory pool: each one's output is read (gathered below) before another
            # replays, and a capture keeps clear of the outputs of those before it
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._body(width)
        self.pool = graph.pool()
        self.graphs[width] = (graph, out)
        self.captures += 1
        return logits[self.rows]


def _storage(lm: torch.nn.Module) -> tuple:
    """Where the model's parameters and buffers live: what a captured graph reads."""
    return tuple(t.data_ptr() for t in (*lm.parameters(), *lm.buffers()))


class GraphSteps:
    """The sampler's decode step on CUDA for a whole run (HFRollout's `decode_step`, called once a generate call):
    a `GraphStep` kept from one call to the next and restarted while it `fits`, so that its graphs are captured once
    a window a run rather than once a call (each capture also synchronises the device and empties the allocator's
    cache: torch.cuda.graph). One a batch size, for the `keep` batch sizes used last (a run's training and evaluation
    batches); a call that does not fit replaces its batch size's step (a longer prompt: buffers rounded up to the
    next multiple of `block`). The buffers stay allocated between calls: the prompt plus new tokens of every row, in
    each layer's keys and values (lib/sharding/memory.kv_bytes_per_token a token)."""

    def __init__(self, block: int = 128, keep: int = 2):
        self.block, self.keep = block, keep
        self.steps: dict[int, GraphStep] = {}  # batch size -> its step, the most recently used last

    def __call__(self, lm: torch.nn.Module, cache: DynamicCache, attention: torch.Tensor,
                 max_new_tokens: int) -> GraphStep:
        batch = attention.shape[0]
        step = self.steps.pop(batch, None)
        if step is not None and step.fits(lm, attention, max_new_tokens):
            step.restart(cache, attention, max_new_tokens)
        else:
            step = None  # its buffers and graphs go before the new ones are allocated
            while len(self.steps) >= self.keep:
                del self.steps[next(iter(self.steps))]
            step = GraphStep(lm, cache, attention, max_new_tokens, block=self.block)
        self.steps[batch] = step
        return step


def decode_step_for(model: torch.nn.Module, device_type: str | None = None):
    """The sampler's decode step for a copy (HFRollout's `decode_step`) on `device_type` (default: the model's):
    for a Llama-family model (`llama_family`), on CUDA `GraphSteps` (graphs kept for the run), or `LlamaStep` where
    the rope type cannot be captured (`host_synced_rope`: "dynamic", "longrope"; eager, the same logits), and
    `LlamaStep` elsewhere; None (the model's own forward) for any other model (Gemma, Phi-3, sliding windows:
    docs/models.md 1)."""
    if not llama_family(model):
        return None
    device_type = device_type or next(model.parameters()).device.type
    if device_type != "cuda":
        return LlamaStep
    return GraphSteps() if graphable(model) else LlamaStep
