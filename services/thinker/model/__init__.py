"""Thinker model: pure PyTorch modules loaded through the checkpoint contract.

Public API (used by the engine, the dump and the tests)::

    model = ThinkerModel.from_checkpoint(Checkpoint(dir), dtype=torch.float32 | torch.bfloat16, device="cpu")

    model.llm            # transformers Qwen3ForCausalLM (call model.llm.model(...) with your own KV cache)
    model.embed_tokens   # = model.llm.model.embed_tokens
    model.lm_head        # = model.llm.lm_head

    model.get_vision_embeds(pixel_values_list, tgt_sizes)        -> Tensor[n_slices, 64, H]
    model.get_audio_embeds(features, feature_lens, chunk_length=1.0)
                                                                  -> list[Tensor[n_i, H]]  (10 rows / s)
    state = model.new_audio_stream()                              # incremental Whisper (duplex, 1 s units)
    model.get_audio_embeds_streaming(mel_100_frames, state, lookahead=next_mel_frames)
                                                                  -> Tensor[10, H]
    model.merge_embeddings(input_ids, vision, image_bounds, audio_list, audio_bounds) -> Tensor[L, H]
    model.embed_prompt(processed)                                 -> inputs_embeds Tensor[L, H]
    model.forward_hidden(inputs_embeds)                           -> (hidden_post_norm [L, H], logits_last [V])
    model.greedy_no_cache(inputs_embeds, steps)                   -> list[int]  (slow reference)

``processed`` is the processor's ``ProcessedPrompt`` (services.thinker.processor). Vision rows replace the
``<unk>`` spans listed in ``image_bounds`` (one span of 64 per slice), audio rows the ``audio_bounds``
spans, in prompt order. Everything runs in the model dtype; the encoders see inputs cast to it.
"""

from services.thinker.model.audio import AudioStreamState, pooled_length
from services.thinker.model.config import ThinkerDims, thinker_dims
from services.thinker.model.thinker import ThinkerModel

__all__ = ["AudioStreamState", "ThinkerDims", "ThinkerModel", "pooled_length", "thinker_dims"]
