"""ai-toolkit's facts, read from its source at :data:`AIT_COMMIT` (github.com/ostris/ai-toolkit): the keys each
config class reads with their defaults and lines (toolkit/config_modules.py), the architectures, optimizers and
timestep types this trainer has a counterpart for.
"""

from __future__ import annotations

from typing import Any, Optional

#: The ai-toolkit commit every line cited here and in the table was read at.
AIT_COMMIT = "27a03a91"

#: The file holding ai-toolkit's config classes; the lines below are in it.
CONFIG_MODULES = "toolkit/config_modules.py"

#: The process types of a job that run ai-toolkit's SDTrainer (extensions_built_in/sd_trainer/__init__.py:8-44).
TRAINER_PROCESSES = ("sd_trainer", "ui_trainer", "diffusion_trainer")

#: The value ai-toolkit reads when a key is not written and the line it is read at, per section (generated from
#: toolkit/config_modules.py: the ``kwargs.get(key, default)`` of SaveConfig, SampleConfig, NetworkConfig,
#: TrainConfig, ModelConfig, DatasetConfig and EMAConfig). ``"<expr>"``: a default computed from other keys.
AIT_KEYS: dict[str, dict[str, tuple[int, Any]]] = {
    "save": {
        "save_every": (25, 1000),
        "dtype": (26, "float16"),
        "max_step_saves_to_keep": (27, 5),
        "save_format": (28, "safetensors"),
        "push_to_hub": (31, False),
        "hf_repo_id": (32, None),
        "hf_private": (33, False),
    },
    "sample": {
        "sampler": (81, "ddpm"),
        "sample_every": (82, 100),
        "sample_start_step": (83, 0),
        "width": (84, 512),
        "height": (85, 512),
        "neg": (86, False),
        "seed": (87, 0),
        "walk_seed": (88, False),
        "guidance_scale": (89, 7),
        "sample_steps": (90, 20),
        "network_multiplier": (91, 1),
        "guidance_rescale": (92, 0.0),
        "format": (93, "jpg"),
        "adapter_conditioning_scale": (94, 1.0),
        "extra_values": (97, []),
        "num_frames": (98, 1),
        "fps": (99, 16),
        "prompts": (104, []),
        "samples": (111, "<expr>"),
        "do_cfg_norm": (114, False),
    },
    "network": {
        "type": (171, "lora"),
        "rank": (172, None),
        "linear": (173, None),
        "conv": (183, None),
        "alpha": (184, 1.0),
        "linear_alpha": (185, "<expr>"),
        "conv_alpha": (186, "<expr>"),
        "dropout": (187, None),
        "network_kwargs": (188, {}),
        "lorm": (191, None),
        "transformer_only": (202, True),
        "lokr_full_rank": (204, True),
        "lokr_factor": (211, -1),
        "old_lokr_format": (214, False),
        "split_multistage_loras": (217, True),
        "layer_offloading": (220, False),
        "pretrained_lora_path": (223, None),
        "all_layers": (227, False),
    },
    "train": {
        "noise_scheduler": (377, "ddpm"),
        "content_or_style": (378, "balanced"),
        "steps": (380, 1000),
        "lr": (381, 1e-06),
        "unet_lr": (382, "<expr>"),
        "text_encoder_lr": (383, "<expr>"),
        "refiner_lr": (384, "<expr>"),
        "embedding_lr": (385, "<expr>"),
        "adapter_lr": (386, "<expr>"),
        "optimizer": (387, "adamw"),
        "optimizer_params": (388, {}),
        "lr_scheduler": (389, "constant"),
        "lr_scheduler_params": (390, {}),
        "min_denoising_steps": (391, 0),
        "max_denoising_steps": (392, 999),
        "batch_size": (393, 1),
        "dtype": (395, "fp32"),
        "xformers": (396, False),
        "sdp": (397, False),
        "attention_backend": (399, "native"),
        "train_unet": (400, True),
        "train_text_encoder": (401, False),
        "train_refiner": (402, True),
        "train_turbo": (403, False),
        "show_turbo_outputs": (404, False),
        "min_snr_gamma": (405, None),
        "snr_gamma": (406, None),
        "learnable_snr_gos": (409, False),
        "noise_offset": (410, 0.0),
        "skip_first_sample": (411, False),
        "force_first_sample": (412, False),
        "gradient_checkpointing": (413, True),
        "weight_jitter": (414, 0.0),
        "merge_network_on_save": (415, False),
        "merge_network_on_save_strength": (416, 1.0),
        "max_grad_norm": (417, 1.0),
        "start_step": (418, None),
        "free_u": (419, False),
        "adapter_assist_name_or_path": (420, None),
        "adapter_assist_type": (421, "t2i"),
        "noise_multiplier": (422, 1.0),
        "target_noise_multiplier": (423, 1.0),
        "random_noise_multiplier": (424, 0.0),
        "do_signal_correction_noise": (425, False),
        "do_batch_noise_correction": (427, False),
        "batch_noise_correction_scale": (428, 0.1),
        "do_signal_amplification": (429, False),
        "signal_amplification_strength": (430, 0.5),
        "signal_correction_noise_scale": (432, 1.0),
        "random_noise_shift": (433, 0.0),
        "img_multiplier": (434, 1.0),
        "noisy_latent_multiplier": (435, 1.0),
        "latent_multiplier": (436, 1.0),
        "negative_prompt": (437, None),
        "max_negative_prompts": (438, 1),
        "reg_weight": (440, 1.0),
        "num_train_timesteps": (441, 1000),
        "adaptive_scaling_factor": (443, False),
        "prompt_dropout_prob": (446, 0.0),
        "match_noise_norm": (451, False),
        "gradient_accumulation_steps": (456, 1),
        "gradient_accumulation": (460, 1),
        "short_and_long_captions": (469, False),
        "short_and_long_captions_encoder_split": (471, False),
        "single_item_batching": (476, False),
        "match_adapter_assist": (478, False),
        "match_adapter_chance": (479, 0.0),
        "inverted_mask_prior": (486, False),
        "inverted_mask_prior_multiplier": (487, 0.5),
        "diff_output_preservation": (490, False),
        "diff_output_preservation_multiplier": (491, 1.0),
        "diff_output_preservation_class": (493, ""),
        "blank_prompt_preservation": (496, False),
        "blank_prompt_preservation_multiplier": (497, 1.0),
        "standardize_images": (504, False),
        "standardize_latents": (505, False),
        "dynamic_noise_offset": (510, False),
        "do_cfg": (511, False),
        "do_random_cfg": (512, False),
        "cfg_scale": (513, 1.0),
        "max_cfg_scale": (514, "<expr>"),
        "cfg_rescale": (515, None),
        "correct_pred_norm": (521, False),
        "correct_pred_norm_multiplier": (522, 1.0),
        "loss_type": (524, "mse"),
        "t0_loss_target": (527, False),
        "t0_velocity_equiv_weight": (528, False),
        "do_fft_loss": (531, False),
        "do_fft_velocity_equiv_weight": (532, False),
        "pred_scaler": (535, 1.0),
        "prompt_saturation_chance": (538, 0.0),
        "do_prior_divergence": (541, False),
        "ema_config": (543, None),
        "target_norm_std": (554, None),
        "target_norm_std_value": (555, 1.0),
        "timestep_type": (556, "sigmoid"),
        "next_sample_timesteps": (557, 8),
        "linear_timesteps": (558, False),
        "linear_timesteps2": (559, False),
        "disable_sampling": (560, False),
        "unload_text_encoder": (564, False),
        "cache_text_embeddings": (566, False),
        "do_paramiter_swapping": (568, False),
        "paramiter_swapping_factor": (570, 0.1),
        "bypass_guidance_embedding": (572, False),
        "latent_feature_extractor_path": (575, None),
        "latent_feature_loss_weight": (576, 1.0),
        "diffusion_feature_extractor_path": (579, "<expr>"),
        "diffusion_feature_extractor_weight": (580, "<expr>"),
        "optimal_noise_pairing_samples": (583, 1),
        "force_consistent_noise": (586, False),
        "blended_blur_noise": (587, False),
        "do_guidance_loss": (590, False),
        "guidance_loss_target": (591, 3.0),
        "do_guidance_loss_cfg_zero": (592, False),
        "guidance_loss_schedule": (597, "constant"),
        "unconditional_prompt": (598, ""),
        "do_differential_guidance": (602, False),
        "differential_guidance_scale": (603, 3.0),
        "switch_boundary_every": (606, 1),
        "do_blank_stabilization": (609, False),
        "audio_loss_multiplier": (611, 1.0),
        "max_loss_debug": (614, False),
        "max_loss": (616, None),
        "validation_config": (618, None),
    },
    "model": {
        "name_or_path": (628, None),
        "is_v2": (631, False),
        "is_xl": (632, False),
        "is_pixart": (633, False),
        "is_pixart_sigma": (634, False),
        "is_auraflow": (635, False),
        "is_v3": (636, False),
        "is_flux": (637, False),
        "is_lumina2": (638, False),
        "use_flux_cfg": (641, False),
        "is_ssd": (642, False),
        "is_vega": (643, False),
        "is_v_pred": (644, False),
        "dtype": (645, "float16"),
        "vae_path": (646, None),
        "refiner_name_or_path": (647, None),
        "refiner_start_at": (649, 0.5),
        "lora_path": (650, None),
        "assistant_lora_path": (652, None),
        "inference_lora_path": (653, None),
        "unconditional_lora_path": (656, None),
        "latent_space_version": (657, None),
        "use_text_encoder_1": (660, True),
        "use_text_encoder_2": (661, True),
        "experimental_xl": (663, False),
        "text_encoder_bits": (676, 16),
        "unet_path": (677, None),
        "unet_sample_size": (678, None),
        "vae_device": (679, None),
        "vae_dtype": (680, "<expr>"),
        "te_device": (681, None),
        "te_dtype": (682, "<expr>"),
        "quantize": (685, False),
        "quantize_te": (686, "<expr>"),
        "qtype": (687, "qfloat8"),
        "qtype_te": (688, "qfloat8"),
        "low_vram": (689, False),
        "attn_masking": (690, False),
        "ignore_if_contains": (694, None),
        "only_if_contains": (695, None),
        "quantize_kwargs": (696, {}),
        "split_model_over_gpus": (699, False),
        "split_model_other_module_param_count_scale": (702, 0.3),
        "te_name_or_path": (704, None),
        "arch": (706, None),
        "auto_memory": (709, False),
        "layer_offloading": (713, "<expr>"),
        "layer_offloading_transformer_percent": (730, 1.0),
        "layer_offloading_text_encoder_percent": (731, 1.0),
        "extras_name_or_path": (736, "<expr>"),
        "accuracy_recovery_adapter": (739, None),
        "compile": (746, False),
        "block_compile": (750, False),
        "compile_mode": (751, "default"),
        "compile_fullgraph": (752, False),
        "compile_dynamic": (753, True),
        "cache_size_limit": (754, None),
        "model_kwargs": (757, {}),
        "model_paths": (760, {}),
        "in_context": (762, False),
    },
    "ema": {
        "use_ema": (827, False),
        "ema_decay": (828, 0.999),
        "use_feedback": (830, False),
        "param_multiplier": (835, 1.0),
    },
    "dataset": {
        "batch_size": (918, None),
        "type": (919, "image"),
        "folder_path": (921, None),
        "dataset_path": (923, None),
        "default_caption": (925, None),
        "trigger_word": (927, None),
        "diff_output_preservation": (930, False),
        "diff_output_preservation_class": (931, ""),
        "random_triggers": (932, []),
        "random_triggers_max": (940, 1),
        "caption_ext": (941, ".txt"),
        "random_scale": (945, False),
        "random_crop": (946, False),
        "resolution": (947, 512),
        "scale": (948, 1.0),
        "buckets": (949, True),
        "bucket_tolerance": (950, 64),
        "is_reg": (951, False),
        "prior_reg": (952, False),
        "network_weight": (953, 1.0),
        "token_dropout_rate": (954, 0.0),
        "shuffle_tokens": (955, False),
        "caption_dropout_rate": (956, 0.0),
        "keep_tokens": (957, 0),
        "flip_x": (958, False),
        "flip_y": (959, False),
        "augments": (960, []),
        "control_path": (961, None),
        "control_from_same_folder": (963, False),
        "num_controls_from_same_folder": (964, 1),
        "control_path_1": (970, None),
        "control_path_2": (971, None),
        "control_path_3": (972, None),
        "control_transparent_color": (985, [0, 0, 0]),
        "inpaint_path": (988, None),
        "full_size_control_images": (990, True),
        "alpha_mask": (991, False),
        "invert_mask": (996, False),
        "mask_min_value": (997, 0.0),
        "poi": (998, None),
        "use_short_captions": (1001, False),
        "num_repeats": (1002, 1),
        "cache_latents": (1004, False),
        "cache_latents_to_disk": (1006, False),
        "cache_tensors_to_disk": (1008, False),
        "cache_clip_vision_to_disk": (1010, False),
        "cache_text_embeddings": (1011, False),
        "load_image_when_caching_latents": (1012, False),
        "standardize_images": (1014, False),
        "augmentations": (1018, None),
        "shuffle_augmentations": (1019, False),
        "caption_type": (1029, None),
        "guidance_type": (1033, "targeted"),
        "clip_image_path": (1036, None),
        "clip_image_from_same_folder": (1038, False),
        "clip_image_augmentations": (1039, None),
        "clip_image_shuffle_augmentations": (1040, False),
        "replacements": (1041, []),
        "loss_multiplier": (1042, 1.0),
        "num_workers": (1044, 2),
        "prefetch_factor": (1045, 2),
        "cache_latents_num_workers": (1047, "<expr>"),
        "extra_values": (1048, []),
        "square_crop": (1049, False),
        "replay_transforms": (1051, True),
        "num_frames": (1056, 1),
        "shrink_video_to_frames": (1059, True),
        "fps": (1064, 24),
        "auto_frame_count": (1069, False),
        "trim_auto_frame_count_tail": (1074, True),
        "debug": (1077, False),
        "controls": (1080, []),
        "fast_image_size": (1087, False),
        "do_i2v": (1089, False),
        "do_audio": (1090, False),
        "audio_preserve_pitch": (1091, False),
        "audio_normalize": (1092, False),
    },
}


def ait_default(section: str, key: str) -> Any:
    """ai-toolkit's default of ``key`` in ``section`` (None when it has none, or it is computed)."""
    line_default = AIT_KEYS.get(section, {}).get(key)
    if line_default is None or line_default[1] == "<expr>":
        return None
    return line_default[1]


def ait_line(section: str, key: str) -> Optional[str]:
    """``toolkit/config_modules.py:N``, where ai-toolkit reads ``key`` of ``section``."""
    line_default = AIT_KEYS.get(section, {}).get(key)
    return f"{CONFIG_MODULES}:{line_default[0]}" if line_default else None


#: ai-toolkit's ``model.arch`` (or its ``is_*`` switches, config_modules.py:764-821) -> our ``model_family``; None:
#: an architecture not trained here. The family's variant (Wan 2.2 experts, Qwen-Image-Edit, Flux Kontext) is read
#: from the model folder, as for every native config.
ARCHES: dict[str, Optional[str]] = {
    "sd1": "sd",
    "sd2": "sd",
    "sdxl": "sdxl",
    "ssd": None,
    "vega": None,
    "sd3": "sd3",
    "flux": "flux",
    "flex1": "flux",
    "flux_kontext": "flux",
    "wan21": "wan",
    "wan21_i2v": None,
    "wan22_14b": "wan",
    "wan22_5b": "wan",
    "wan22_14b_i2v": "wan",
    "qwen_image": "qwen_image",
    "qwen_image_edit": "qwen_image",
    "qwen_image_edit_plus": None,
}

#: The ``is_*`` switches of ModelConfig and the arch each means when ``arch`` is unset (config_modules.py:799-821).
ARCH_SWITCHES: dict[str, str] = {
    "is_v2": "sd2",
    "is_v3": "sd3",
    "is_xl": "sdxl",
    "is_pixart": "pixart",
    "is_pixart_sigma": "pixart_sigma",
    "is_auraflow": "auraflow",
    "is_flux": "flux",
    "is_lumina2": "lumina2",
    "is_vega": "vega",
    "is_ssd": "ssd",
}

#: The families ai-toolkit trains with its ``flowmatch`` noise scheduler; the others with ``ddpm``.
FLOW_FAMILIES = ("sd3", "flux", "wan", "qwen_image")

#: ai-toolkit's optimizer names (toolkit/optimizer.py:12-110, lower-cased) -> ours. Its torch / bitsandbytes
#: Adam variants get ``eps=1e-6`` there (optimizer.py:66-71, 76-79), written as our ``adam_epsilon``.
OPTIMIZERS: dict[str, str] = {
    "adamw": "adamw",
    "adam": "adam",
    "adamw8bit": "bnb-adamw8bit",
    "automagic": "automagic",
    "prodigy": "prodigy",
    "adafactor": "torch-adafactor",
}

#: The optimizers whose ``eps`` ai-toolkit sets to 1e-6 (toolkit/optimizer.py:54, 70-71, 76-79).
EPS_1E6 = ("adamw", "adam", "adamw8bit", "prodigy")

#: What differs between ai-toolkit's optimizer of that name (toolkit/optimizer.py) and the one it maps to here,
#: as the translation warns it. adamw / adam / adamw8bit are the same class with the same arguments there and here.
OPTIMIZER_DIFFERENCES: dict[str, str] = {
    "prodigy": (
        "prodigyopt's Prodigy with eps 1e-6 and lr 1.0 below 0.1 as there (optimizer.py:46-54); here each param "
        "group estimates its own step size (`split_groups`: Wan 2.2's two experts differ, one group is the same)"
    ),
    "automagic": (
        "this trainer's Automagic, not ai-toolkit's (toolkit/optimizers/automagic.py): the same defaults (min_lr "
        "1e-7, max_lr 1e-3, lr_bump 1e-6, beta2 0.999, eps 1e-30, clip_threshold 1, weight decay 0; a start above "
        "1e-3 reset to 1e-6: automagic.py:12-26), factored second moments, RMS clip, +/- lr_bump by sign agreement "
        "and decoupled weight decay; it differs in: the first step (ai-toolkit compares the first update's sign "
        "with an all-negative one, so every element's lr moves by a bump, automagic.py:246-266 and 300-302; here "
        "it stays); a zero update (negative there, here it neither raises nor lowers the lr); bias correction "
        "(none there, automagic.py:218-239, so its RMS clip fires on every early step and the update has RMS 1; "
        "here Adam-style, clipped only above RMS 1); the stored lr (int8 scaled by the parameter's largest lr "
        "there, re-rounded every step, automagic.py:271 and optimizer_utils.py:168-181, an lr below 1/254 of the "
        "largest stored as 0; a 65,536-point grid here); a learning-rate schedule (ai-toolkit's Automagic never "
        "reads the group lr, so `lr_scheduler` does not change it there; here it scales every element's lr); "
        "3-D and larger parameters (factored over the last two dimensions there, as (shape[0], rest) here); a "
        "start below min_lr (clamped at the first step there, refused here); fp16 weights (rounded "
        "stochastically there, to nearest here; bf16 stochastically in both); ai-toolkit's `beta2`, `eps`, "
        "`clip_threshold` and parameter-swapping settings are not read (they stop)"
    ),
    "adafactor": (
        "torch's Adafactor here, ai-toolkit's own there (toolkit/optimizers/adafactor.py, with relative_step, "
        "scale_parameter and warmup_init off: optimizer.py:88-96): torch's steps by min(lr, 1/sqrt(step)) times the "
        "parameter's RMS, ai-toolkit's by lr alone (adafactor.py:195-204), and rounds bf16 weights stochastically "
        "(adafactor.py:359-361); no gradient clipping, as there (SDTrainer.py:2278)"
    ),
}

#: ``train.dtype`` spellings -> our ``mixed_precision``.
DTYPES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "no",
    "float32": "no",
    "float": "no",
}

#: ``model.qtype`` values -> our ``base_model_precision``: quanto's types, as ai-toolkit's
#: (toolkit/util/quantize.py:65-72), except ``float8``, torchao's float8 weight-only there (quantize.py:42-49),
#: quanto's qfloat8 here; an accuracy-recovery adapter (``qtype: "uint4|adapter"``) is not read here.
QTYPES: dict[str, str] = {
    "qfloat8": "qfloat8",
    "float8": "qfloat8",
    "qint8": "qint8",
    "qint4": "qint4",
    "qint2": "qint2",
}
