"""Model shapes train_embedded.py builds, and their LlavaConfig."""

# Model shapes. "scenes-6m" is the embedded default (kvlens-scenes-6m, classic scenes);
# "scenes-deep" has LLaVA-1.5's geometry (336 px, 14-px patches: 576 visual tokens; feature layer
# -2, "default" strategy, the 2-layer GELU projector) and a 12-layer Llama decoder (MHA, head_dim
# 64), for the rich scenes (kvlens scenes --generator-version 2): about 14 M parameters, 27 MiB
# in fp16.
PRESETS = {
    "scenes-6m": dict(image_size=224, patch_size=16, vision_hidden=192, vision_mlp=768, vision_layers=6,
                      vision_heads=6, hidden=256, mlp=768, layers=4, heads=8, head_dim=32, max_new_tokens=40),
    "scenes-deep": dict(image_size=336, patch_size=14, vision_hidden=192, vision_mlp=768, vision_layers=6,
                        vision_heads=6, hidden=256, mlp=768, layers=12, heads=4, head_dim=64, max_new_tokens=96),
}


def llava_config(P, text_vocab, image_token_index, max_pos, bos_id, eos_id):
    """A LlavaConfig of preset P: a CLIP tower, the 2-layer GELU projector, a Llama decoder (MHA)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    vision = CLIPVisionConfig(
        image_size=P["image_size"], patch_size=P["patch_size"], hidden_size=P["vision_hidden"],
        intermediate_size=P["vision_mlp"], num_hidden_layers=P["vision_layers"],
        num_attention_heads=P["vision_heads"], hidden_act="quick_gelu", num_channels=3)
    text = LlamaConfig(
        hidden_size=P["hidden"], intermediate_size=P["mlp"], num_hidden_layers=P["layers"],
        num_attention_heads=P["heads"], num_key_value_heads=P["heads"], head_dim=P["head_dim"],
        max_position_embeddings=max_pos, vocab_size=text_vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None, tie_word_embeddings=False)
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_index,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        image_seq_length=(P["image_size"] // P["patch_size"]) ** 2, tie_word_embeddings=False)
