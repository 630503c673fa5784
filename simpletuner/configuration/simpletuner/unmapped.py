"""The keys of SimpleTuner's dialect with no counterpart here, and why: each a row ``(key, section, kind, note)``
of :data:`TAIL`. ``ignored``: running without it trains the same weights (listed once); ``unsupported``: it
changes what is trained and the run stops, naming it. :data:`TAIL_DEFAULTS`: SimpleTuner's defaults of the
unsupported keys whose default is not already "off", so spelling one out asks for nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from simpletuner.configuration.families import FAMILY_NAMES
from simpletuner.configuration.simpletuner.reading import Section

#: The kinds of :mod:`.reading` an unmapped key can have.
UnmappedKind = Literal["ignored", "unsupported"]
Entry = tuple[str, Section, UnmappedKind, str]

# --- ignored: no effect on what is trained -------------------------------------------------------
_PUBLISH = (
    "uploads to other storage (S3, Backblaze B2, Azure Blob, Dropbox) are not implemented here; Hub uploads are "
    "`push_to_hub`"
)
_WEBHOOK = "webhooks are not implemented here: progress is in the log and the tracker (`report_to`)"
_HOOK_SCRIPT = "hook scripts are not run by this trainer: run yours on the checkpoint folders in `output_dir`"
_UPLOAD_HOOK = (
    "hook scripts are not run by this trainer (SimpleTuner runs this one after each upload or save): run yours "
    "when the run has ended"
)
_LOGGING = "logging and debug output only"
_MEMORY = "a memory or speed setting with no effect on what is trained; memory is managed here by the trainer"
_CHECKPOINTING = "gradient checkpointing is on or off here (`gradient_checkpointing`): a memory/speed trade only"
_COMPILE = "torch.compile is switched on with `enable_compile` here"
_ATTENTION = "attention backend: PyTorch's scaled_dot_product_attention is used"
_PROCESSES = "processes and parallelism come from `accelerate launch`; no effect on what is trained"
_CACHE = "latents and text embeddings are cached once under `cache_config.cache_dir` and checked by fingerprint"
_LOADING = "data-loading parallelism only; `dataloader_num_workers` sets the image-decoding threads here"
_DISK = "free disk space is checked before each save here; a save that cannot fit stops with an explanation"
_SAVES = "checkpoints are saved every `checkpointing_steps` optimizer steps and at the end of the run"
_KEEP_FILES = "source files are never deleted here; unreadable or too-small images are skipped and counted"
_VALIDATION = "validation only: it does not change training; validation here renders `validation_prompt` images"
_VALIDATION_WHEN = "validation runs every `validation_steps` optimizer steps (and at the start and end)"
_OTHER_VALIDATION = "validation setting of a model family this trainer does not support; no effect on training"
_STAGED_VALIDATION = "validation here runs the trained model alone (no base/refiner or other-stage pipeline)"
_EVALUATION = "SimpleTuner's evaluation metrics are not computed; `eval_steps` / `eval_iters` log a fixed-noise loss"
_FROZEN_PRECISION = (
    "precision of a frozen part (VAE in fp32, text encoders unquantised, the base in the `mixed_precision` dtype)"
)
_BUCKETS = (
    "repeats are used as given and a bucket smaller than one step's batch is left out, with a warning naming it "
    "(nothing is left out at a batch of 1)"
)
_SDNQ = "SDNQ options act only with SDNQ `base_model_precision` presets, which are not supported here"
_MEMORY_BACKEND = "tmpfs cache backends: set `cache_config.vae_cache_type` / `text_cache_type` to `memory` instead"

# --- unsupported: would change what is trained ---------------------------------------------------
_CSV = "URL-list (CSV) datasets are not downloaded here: fetch the images to a local folder and use type local"
_WEBSHART = "Webshart shard datasets are not supported: unpack the images to a local folder and use type local"
_CONTROLNET = (
    "read by SimpleTuner's HiDream ControlNet only (models/hidream/model.py:307); its sdxl and flux ControlNets, "
    "the ones trained here, never read it"
)
_CONTROL = "channel-wise control training is not supported: remove it"
_CONDITIONING = (
    "several conditioning datasets for one training dataset (Edit Plus, multi-reference) are not supported: name one "
    "`dataset_type: conditioning` entry in `conditioning_data`"
)
_EDIT_EMBEDS = (
    "Qwen-Image-Edit's prompt embedding is cached with the text embeddings, keyed by caption and source image "
    "(no separate folder)"
)
_DISTILLATION = "distillation is not supported: train a LoRA or a full fine-tune without it"
_DIFFUSION_BLOCKS = "block-wise (DiffusionBlocks) training is not supported: remove it"
_CREPA = "CREPA (cross-frame representation alignment) is not implemented: remove the crepa_* keys"
_UREPA = "U-REPA (representation alignment) is not implemented: remove the urepa_* keys"
_IREPA = "iREPA is not implemented: remove the irepa_* keys"
_LAYERSYNC = "LayerSync hidden-state alignment is not implemented: remove the layersync_* keys"
_NEXTLAT = "NextLat hidden-state prediction is not implemented: remove the nextlat_* keys"
_XM = "XM candidate selection is not implemented: remove the xm_* keys"
_INTERNAL_GUIDANCE = "the internal-guidance auxiliary head is not implemented: remove the internal_guidance_* keys"
_SCHEDULED_SAMPLING = "scheduled sampling (rollout training) is not implemented: remove the scheduled_sampling_* keys"
_DIFF2FLOW = "the Diffusion-to-Flow bridge is not implemented (the model trains on its own target): remove it"
_MIXFLOW = "MixFlow post-training is not implemented: remove the mixflow_* keys"
_TIMESTEPS = "timesteps are drawn by `timestep_sampling` (uniform, logit_normal or mode) here: use it instead"
_NOISE_SCHEDULE = "the model's own noise schedule is used unchanged: remove it"
_LOSS = "the loss here is mean squared error weighted by `loss_weighting` (none, min_snr, ...): remove it"
_LR_SCALE = "the learning rate is used as given: multiply `learning_rate` yourself"
_TEXT_ENCODER = (
    "`train_text_encoder` trains a LoRA on every layer of the text encoders for the whole run; freezing some of "
    "their layers or stopping early is not supported: remove it"
)
_PROMPT_ENCODING = "prompts are encoded with the model family's standard settings: remove it"
_LORA_TARGETS = "the adapted modules are set by `lora_target_modules` (a list of module names): use it instead"
_LORA_VARIANT = "only standard LoRA, DoRA and LyCORIS adapters are trained here: remove it"
_INIT_ADAPTER = "training cannot start from an existing adapter yet: remove it"
_COMPONENTS = "components load from the model folder (`pretrained_model_name_or_path`): put this one in its subfolder"
_VARIANT = "the model folder's default weight files are loaded: point `pretrained_model_name_or_path` at them"
_QUANTISATION = "quantisation here is `base_model_precision` only (qint8, qfloat8, int8_torchao, fp8_torchao)"
_REFINER = "refiner / expert-stage training is not supported (Wan 2.2 experts: `train_stages`): remove it"
_NSFW = "NSFW filtering of the data is not implemented: filter the dataset folder beforehand"
_GROUNDING = "grounding (bounding-box conditioning) is not supported: remove it"
_DATASET_SCHEDULE = "datasets cannot be switched on or off by epoch or step: every dataset is sampled for the run"
_PER_DATASET = "here it is a key of each dataset entry: set it in the entries of the dataset list"
_UPSCALE = "images smaller than their bucket are governed by each dataset's `allow_upscale` here: use it instead"
_CAPTION_EDIT = "captions are used as written: edit the caption files beforehand"
_AUDIO = "audio models and audio datasets are not supported: remove it"
_SAGE = "SageAttention is not used here (training uses PyTorch SDPA): remove it"
_SLA = "Sparse-Linear Attention (trained SLA projections) is not supported: remove it"


def _family(name: str) -> str:
    return f"{name} is not a model family this trainer supports ({', '.join(FAMILY_NAMES)}): remove it"


def _group(keys: str, kind: UnmappedKind, note: str, section: Section = "top") -> tuple[Entry, ...]:
    return tuple((key, section, kind, note) for key in keys.split())


def _ignored(keys: str, note: str, section: Section = "top") -> tuple[Entry, ...]:
    return _group(keys, "ignored", note, section)


def _unsupported(keys: str, note: str, section: Section = "top") -> tuple[Entry, ...]:
    return _group(keys, "unsupported", note, section)


_TOP_IGNORED = (
    *_ignored("controlnet_custom_config", _CONTROLNET),
    *_ignored("post_upload_script", _UPLOAD_HOOK),
    *_ignored("publishing_config", _PUBLISH),
    *_ignored("webhook_config webhook_reporting_interval", _WEBHOOK),
    *_ignored("post_checkpoint_script", _HOOK_SCRIPT),
    *_ignored("modelspec_comment", "saved adapter files carry no model-spec comment; the weights are the same"),
    *_ignored("debug_aspect_buckets debug_dataset_loader print_filenames print_sampler_statistics", _LOGGING),
    *_ignored("tracker_image_layout", _LOGGING),
    *_ignored(
        "accelerator_cache_clear_interval enable_model_cpu_offload enable_group_offload group_offload_blocks_per_group "
        "group_offload_to_disk_path group_offload_type group_offload_use_stream musubi_block_swap_device "
        "musubi_blocks_to_swap ramtorch ramtorch_controlnet ramtorch_disable_extensions ramtorch_disable_sync_hooks "
        "ramtorch_target_modules ramtorch_text_encoder ramtorch_text_encoder_percent ramtorch_transformer_percent "
        "ramtorch_vae offload_during_startup offload_during_save offload_param_path keep_vae_loaded "
        "fully_unload_text_encoder unet_attention_slice vae_enable_slicing vae_enable_tiling vae_enable_patch_conv "
        "vae_enable_temporal_roll fuse_qkv_projections fuse_optimizer optimizer_cpu_offload_method "
        "optimizer_offload_gradients optimizer_release_gradients set_grads_to_none ema_foreach_disable quantize_via",
        _MEMORY,
    ),
    *_ignored(
        "gradient_checkpointing_interval gradient_checkpointing_backend gradient_checkpointing_offload_attention "
        "gradient_checkpointing_offload_pin_memory_max_buckets gradient_checkpointing_offload_prefetch "
        "gradient_checkpointing_segment_stride",
        _CHECKPOINTING,
    ),
    *_ignored("dynamo_backend dynamo_mode dynamo_fullgraph dynamo_use_regional_compilation", _COMPILE),
    *_ignored("attention_mechanism", _ATTENTION),
    *_ignored(
        "local_rank num_processes find_unused_parameters context_parallel_size context_parallel_comm_strategy",
        _PROCESSES,
    ),
    *_ignored(
        "cache_dir cache_dir_text cache_dir_vae vae_cache_scan_behaviour vae_cache_ondemand vae_cache_disable "
        "text_cache_ondemand text_cache_disable text_embed_full_cache compress_disk_cache skip_file_discovery "
        "preserve_data_backend_cache override_dataset_config metadata_update_interval",
        _CACHE,
    ),
    *_ignored(
        "aspect_bucket_worker_count aspect_bucket_disable_rebuild image_processing_batch_size max_workers "
        "read_batch_size write_batch_size enable_multiprocessing dataloader_prefetch "
        "dataloader_prefetch_qlen text_encoder_batch_size",
        _LOADING,
    ),
    *_ignored(
        "torch_num_threads",
        "SimpleTuner passes it to torch.set_num_threads (default 8; trainer.py `_misc_init`); here a CPU run "
        "picks a count that does not oversubscribe the cores it may use, and `num_cpu_threads` sets it. Speed "
        "only: no effect on what is trained",
    ),
    *_ignored(
        "sdnq_compile_mode sdnq_dequantize_fp32 sdnq_group_size sdnq_hadamard_group_size sdnq_modules_dtype_dict "
        "sdnq_modules_quant_config sdnq_modules_to_not_convert sdnq_modules_to_not_use_matmul "
        "sdnq_quantized_matmul_dtype sdnq_svd_rank sdnq_svd_steps sdnq_use_hadamard sdnq_use_quantized_matmul "
        "sdnq_use_static_quantization sdnq_use_stochastic_rounding sdnq_use_svd sdnq_weights_dtype",
        _SDNQ,
    ),
    *_ignored("allow_dataset_oversubscription disable_bucket_pruning", _BUCKETS),
    *_ignored(
        "aws_max_pool_connections",
        "S3 connection pool size only; an `object_store` dataset sets it in "
        "`storage_options.config_kwargs.max_pool_connections`",
    ),
    *_ignored("disk_low_threshold disk_low_action disk_low_script", _DISK),
    *_ignored("checkpoint_epoch_interval checkpointing_rolling_steps checkpoints_rolling_total_limit", _SAVES),
    *_ignored("checkpointing_use_tempdir", "checkpoints are always written to a temporary folder, then renamed"),
    *_ignored(
        "delete_invalid_checkpoints",
        "a checkpoint that cannot be loaded stops the resume with an explanation; nothing is deleted",
    ),
    *_ignored("delete_model_after_load", "models are read from a local folder; nothing is deleted"),
    *_ignored("delete_unwanted_images delete_problematic_images ignore_missing_files", _KEEP_FILES),
    *_ignored(
        "i_know_what_i_am_doing",
        "read only where SimpleTuner lets it lift a forced setting that trains here: SD3's T5 length cap "
        "(`tokenizer_max_length`) and Qwen-Image's 32 px bucket alignment",
    ),
    *_ignored("trust_remote_code", "supported families load from diffusers folders without custom code"),
    *_ignored("save_text_encoder", "text encoders stay frozen and are not saved"),
    *_ignored(
        "vae_dtype base_model_default_dtype text_encoder_1_precision text_encoder_2_precision "
        "text_encoder_3_precision text_encoder_4_precision gradient_precision",
        _FROZEN_PRECISION,
    ),
    *_ignored(
        "disable_segmented_timestep_sampling",
        "timesteps are drawn independently per sample here (as with this set to true)",
    ),
    *_ignored(
        "training_scheduler_timestep_spacing",
        "training timesteps are drawn from the whole schedule; spacing only matters when sampling",
    ),
    *_ignored(
        "framerate",
        "read only for the default `num_frames` of a video dataset without `video.num_frames` (5 s at it, as in "
        "SimpleTuner); clips train on `num_frames` frames taken `frame_stride` apart, and validation videos are "
        "written at the family's rate (Wan: 16 fps; SimpleTuner writes Wan's at its `framerate`, which it sets to 15 "
        "when unset, wan/model.py:1555-1556, validation.py:2539)",
    ),
    *_ignored(
        "validation_adapter_config validation_adapter_mode validation_adapter_name validation_adapter_path "
        "validation_adapter_strength validation_audio_duration validation_audio_only validation_disable_unconditional "
        "validation_guidance_real validation_guidance_skip_layers validation_guidance_skip_layers_start "
        "validation_guidance_skip_layers_stop validation_guidance_skip_scale validation_image_format "
        "validation_image_quality validation_input validation_internal_guidance_scale validation_lycoris_strength "
        "validation_lyrics validation_method validation_external_script validation_external_background "
        "validation_no_cfg_until_timestep validation_noise_scheduler validation_preview validation_preview_steps "
        "validation_prompt_library user_prompt_library validation_randomize validation_seed_source "
        "validation_stitch_input_location validation_torch_compile validation_using_datasets "
        "inference_scheduler_timestep_spacing enable_watermark",
        _VALIDATION,
    ),
    *_ignored("validation_epoch_interval validate_after_epoch validate_after_step", _VALIDATION_WHEN),
    *_ignored("validation_on_startup disable_benchmark", "validation also runs at the start here (with a prompt)"),
    *_ignored("validation_disable", "validation runs only when `validation_prompt` is set: leave it out instead"),
    *_ignored(
        "deepfloyd_validation_pipeline_mode deepfloyd_validation_stage1_guidance deepfloyd_validation_stage1_model "
        "deepfloyd_validation_stage1_num_inference_steps deepfloyd_validation_stage2_guidance "
        "deepfloyd_validation_stage2_model deepfloyd_validation_stage2_num_inference_steps "
        "deepfloyd_validation_stage3_guidance deepfloyd_validation_stage3_mode deepfloyd_validation_stage3_model "
        "deepfloyd_validation_stage3_noise_level pixart_validation_pipeline_mode pixart_validation_stage1_model "
        "pixart_validation_stage2_model ltx2_validation_audio_guidance ltx2_validation_pipeline_mode "
        "ltx2_validation_spatial_upsampler_filename ltx2_validation_spatial_upsampler_model "
        "validation_ltx2_video_conditioning ideogram_validation",
        _OTHER_VALIDATION,
    ),
    *_ignored(
        "sdxl_validation_pipeline_mode sdxl_validation_stage1_model sdxl_validation_stage2_model "
        "wan_validation_load_other_stage",
        _STAGED_VALIDATION,
    ),
    *_ignored(
        "eval_dataset_id eval_dataset_pooling eval_epoch_interval eval_loss_disable eval_steps_interval "
        "eval_timesteps evaluation_type num_eval_images pretrained_evaluation_model_name_or_path",
        _EVALUATION,
    ),
)

_TOP_UNSUPPORTED = (
    *_unsupported("control", _CONTROL),
    *_unsupported("conditioning_multidataset_sampling", _CONDITIONING),
    *_unsupported("distillation_config distillation_method", _DISTILLATION),
    *_unsupported("diffusion_blocks_config", _DIFFUSION_BLOCKS),
    *_unsupported(
        "crepa_adjacent_distance crepa_adjacent_tau crepa_block_index crepa_cumulative_neighbors crepa_cutoff_step "
        "crepa_decay_steps crepa_enabled crepa_encoder_frames_batch_size crepa_encoder_image_size "
        "crepa_feature_source crepa_lambda crepa_lambda_end crepa_model crepa_normalize_by_frames "
        "crepa_normalize_neighbour_sum crepa_power crepa_scheduler crepa_self_flow crepa_self_flow_mask_ratio "
        "crepa_similarity_ema_decay crepa_similarity_threshold crepa_spatial_align crepa_teacher_block_index "
        "crepa_threshold_mode crepa_use_backbone_features crepa_warmup_steps",
        _CREPA,
    ),
    *_unsupported(
        "urepa_cutoff_step urepa_decay_steps urepa_enabled urepa_encoder_image_size urepa_lambda urepa_lambda_end "
        "urepa_manifold_weight urepa_model urepa_power urepa_scheduler urepa_similarity_ema_decay "
        "urepa_similarity_threshold urepa_threshold_mode urepa_use_tae urepa_warmup_steps",
        _UREPA,
    ),
    *_unsupported("irepa_enabled irepa_projector_kernel_size irepa_spatial_norm_alpha", _IREPA),
    *_unsupported("layersync_enabled layersync_lambda layersync_student_block layersync_teacher_block", _LAYERSYNC),
    *_unsupported("nextlat_block_index nextlat_enabled nextlat_kl_weight nextlat_state_loss nextlat_weight", _NEXTLAT),
    *_unsupported("xm_block_size xm_candidate_count xm_enabled xm_selection_scope xm_training_target", _XM),
    *_unsupported(
        "internal_guidance_block_index internal_guidance_enabled internal_guidance_loss_weight", _INTERNAL_GUIDANCE
    ),
    *_unsupported(
        "scheduled_sampling_max_step_offset scheduled_sampling_order scheduled_sampling_prob_end "
        "scheduled_sampling_prob_start scheduled_sampling_probability scheduled_sampling_ramp_shape "
        "scheduled_sampling_ramp_steps scheduled_sampling_reflexflow scheduled_sampling_reflexflow_alpha "
        "scheduled_sampling_reflexflow_beta1 scheduled_sampling_reflexflow_beta2 scheduled_sampling_sampler "
        "scheduled_sampling_start_step scheduled_sampling_strategy",
        _SCHEDULED_SAMPLING,
    ),
    *_unsupported("diff2flow_enabled diff2flow_loss", _DIFF2FLOW),
    *_unsupported("mixflow_enabled mixflow_gamma", _MIXFLOW),
    *_unsupported(
        "timestep_bias_begin timestep_bias_end timestep_bias_multiplier timestep_bias_portion timestep_bias_strategy "
        "flow_custom_timesteps flow_timesteps_mode flow_cubic_schedule_weights flow_beta_schedule_alpha "
        "flow_beta_schedule_beta",
        _TIMESTEPS,
    ),
    *_unsupported("flow_schedule_auto_shift", "the flow shift is fixed here: set `flow_schedule_shift` instead"),
    *_unsupported("input_perturbation input_perturbation_steps", _NOISE_SCHEDULE),
    *_unsupported("use_soft_min_snr soft_min_snr_sigma_data snr_weight", _LOSS),
    *_ignored(
        "lr_num_cycles",
        "SimpleTuner passes it only to diffusers schedules that do not read it (its cosine schedules are its own)",
    ),
    *_unsupported("lr_scale lr_scale_sqrt", _LR_SCALE),
    *_unsupported("prodigy_steps", "Prodigy runs with its own defaults here: remove it"),
    *_unsupported(
        "strict_epoch_limit",
        "training stops at `max_train_steps`, or at `num_train_epochs` when that is unset: leave out `max_train_steps`",
    ),
    *_unsupported(
        "text_encoder_limit freeze_encoder_after freeze_encoder_before freeze_encoder_strategy",
        _TEXT_ENCODER,
    ),
    *_unsupported("layer_freeze_strategy", "full training trains every denoiser weight here: remove it"),
    *_unsupported(
        "t5_padding custom_text_encoder_intermediary_layers sd3_clip_uncond_behaviour sd3_t5_uncond_behaviour",
        _PROMPT_ENCODING,
    ),
    *_unsupported("peft_lora_target_modules flux_lora_target slider_lora_target", _LORA_TARGETS),
    *_unsupported("peft_lora_mode singlora_ramp_up_steps init_lokr_norm", _LORA_VARIANT),
    *_unsupported("init_lora_step init_lora_ema", _INIT_ADAPTER),
    *_unsupported(
        "ema_warmup_steps", "EMA warm-up is not implemented: the EMA copy follows `ema_decay` from the start"
    ),
    *_unsupported(
        "pretrained_unet_model_name_or_path pretrained_unet_subfolder pretrained_transformer_subfolder "
        "pretrained_t5_model_name_or_path pretrained_gemma_model_name_or_path qwen_text_encoder_model_name_or_path",
        _COMPONENTS,
    ),
    *_unsupported("variant", _VARIANT),
    *_unsupported(
        "quantization_config quantize_activations",
        _QUANTISATION,
    ),
    *_unsupported("sageattention_usage", _SAGE),
    *_unsupported("sla_config", _SLA),
    *_unsupported(
        "refiner_training refiner_training_invert_schedule refiner_training_strength sdxl_refiner_uses_full_range "
        "data_aesthetic_score",
        _REFINER,
    ),
    *_unsupported(
        "enable_nsfw_check nsfw_check_backend_types nsfw_check_min_votes nsfw_check_models nsfw_check_sample_types "
        "nsfw_check_video_frame_count nsfw_check_video_frame_selection nsfw_check_video_min_flagged_frames "
        "delete_nsfw_images",
        _NSFW,
    ),
    *_unsupported("max_grounding_entities pretrained_grounding_model_name_or_path", _GROUNDING),
    *_unsupported(
        "data_backend_sampling",
        "datasets are sampled in proportion to their size (SimpleTuner's `auto-weighting`); `uniform` is not available",
    ),
    *_unsupported("instance_prompt prepend_instance_prompt", _PER_DATASET),
    *_unsupported("only_instance_prompt", "set `caption_strategy: instance_prompt` on each dataset entry instead"),
    *_unsupported("max_upscale_threshold", _UPSCALE),
    *_unsupported("parquet_caption_column parquet_filename_column", "set the columns in the dataset's `parquet` block"),
    *_unsupported("flux_attention_masked_training flux_fast_schedule", "Flux trains without it here: remove it"),
    *_unsupported("hidream_load_balancing_loss_weight hidream_use_load_balancing_loss", _family("HiDream")),
    *_unsupported(
        "ltx_i2v_prob ltx_partial_noise_fraction ltx_protect_first_frame ltx_train_mode "
        "ltx2_first_frame_conditioning_probability ltx2_intrinsic_conditioning ltx2_mask_conditioning_probability "
        "ltx2_prefix_conditioning_frames ltx2_prefix_conditioning_probability ltx2_reference_spatial_scale_factor "
        "ltx2_reference_temporal_scale_factor ltx2_suffix_conditioning_frames ltx2_suffix_conditioning_probability",
        _family("LTX-Video"),
    ),
    *_unsupported(
        "minimax_h3_sparse_attention minimax_h3_sparse_block_shape minimax_h3_sparse_share_heads "
        "minimax_h3_sparse_start_layer minimax_h3_sparse_video_kv_fraction minimax_h3_target_mode",
        _family("MiniMax-H3"),
    ),
    *_unsupported(
        "minimax_music_lm_adapter minimax_music_lm_adapter_strength minimax_music_lm_max_frames "
        "minimax_music_lm_precache_mode minimax_music_train_component audio_flow_schedule_shift",
        _AUDIO,
    ),
    *_unsupported("cosmos3_generator_component cosmos3_reasoner_component", _family("Cosmos 3")),
    *_unsupported(
        "ideogram_auto_json ideogram_fp8_base_upcast ideogram_prompt_enhancer_head_id ideogram_prompt_upsample "
        "ideogram_schedule_mu ideogram_schedule_std",
        _family("Ideogram"),
    ),
    *_unsupported("krea2_reference_latents", _family("Krea 2")),
    *_unsupported("sana_complex_human_instruction", _family("Sana")),
)

_DATASET_IGNORED = (
    *_ignored(
        "image_embeds cache_file_suffix "
        "vae_cache_ondemand vae_cache_disable text_cache_ondemand text_cache_disable skip_file_discovery "
        "preserve_data_backend_cache metadata_update_interval",
        _CACHE,
        "dataset",
    ),
    *_ignored("text_encoder_batch_size write_batch_size", _LOADING, "dataset"),
    *_ignored(
        "conditioning_image_embeds cache_dir_conditioning_image_embeds conditioning_image_embed_batch_size",
        _EDIT_EMBEDS,
        "dataset",
    ),
    *_ignored("memory_filesystem_path memory_filesystem_size memory_filesystem_sudo", _MEMORY_BACKEND, "dataset"),
    *_ignored("delete_unwanted_images delete_problematic_images", _KEEP_FILES, "dataset"),
    *_ignored("hash_filenames", "cache file names are chosen here (SimpleTuner ignores this key too)", "dataset"),
    *_ignored("ignore_epochs", "deprecated in SimpleTuner, where it does nothing", "dataset"),
    *_ignored(
        "metadata_backend",
        "files are found by scanning `instance_data_dir` (a Hub dataset: the rows of its split's Parquet files); a "
        "`parquet` block supplies captions and sizes",
        "dataset",
    ),
)

_DATASET_UNSUPPORTED = (
    *_unsupported("csv_file csv_caption_column csv_cache_dir", _CSV, "dataset"),
    *_unsupported(
        "source metadata webshart webshart_optimise_captions webshart_optimize_captions", _WEBSHART, "dataset"
    ),
    *_unsupported("audio", _AUDIO, "dataset"),
    *_unsupported("grounding", _GROUNDING, "dataset"),
    *_unsupported("delete_nsfw_images", _NSFW, "dataset"),
    *_unsupported("caption_filter_list", _CAPTION_EDIT, "dataset"),
    *_unsupported("start_epoch start_step end_epoch end_step", _DATASET_SCHEDULE, "dataset"),
    *_unsupported(
        "max_num_samples",
        "a dataset cannot be cut to N samples here: copy the subset to its own folder",
        "dataset",
    ),
    *_unsupported(
        "max_upscale_threshold",
        _UPSCALE,
        "dataset",
    ),
    *_unsupported(
        "train_batch_size",
        "one top-level `train_batch_size` serves every dataset here: remove the per-dataset value",
        "dataset",
    ),
    *_unsupported("timestep_sampling_offset", _TIMESTEPS, "dataset"),
    *_unsupported("slider_strength", "slider training is not supported: remove it", "dataset"),
)

#: Every SimpleTuner key the mapped tables do not map: (key, section, kind, note).
TAIL: tuple[Entry, ...] = _TOP_IGNORED + _TOP_UNSUPPORTED + _DATASET_IGNORED + _DATASET_UNSUPPORTED

#: SimpleTuner's defaults (its field registry at the snapshot's commit) for the top-level unsupported
#: keys of TAIL whose default is not already off (false, null, 0, ""): a config that spells out one of
#: these values asks for nothing this trainer lacks. Left out on purpose: `lr_end` (4e-7) and `lr_power`
#: (0.8), whose defaults differ from diffusers' polynomial schedule used here, and `flux_lora_target`
#: ("all"), whose default adapts more Flux layers than this trainer's default does.
TAIL_DEFAULTS: dict[str, Any] = {
    "conditioning_multidataset_sampling": "random",
    "cosmos3_generator_component": "auto",
    "cosmos3_reasoner_component": "auto",
    "crepa_adjacent_distance": 1,
    "crepa_adjacent_tau": 1.0,
    "crepa_block_index": 8,
    "crepa_encoder_frames_batch_size": -1,
    "crepa_encoder_image_size": 518,
    "crepa_feature_source": "encoder",
    "crepa_lambda": 0.5,
    "crepa_normalize_by_frames": True,
    "crepa_power": 1.0,
    "crepa_scheduler": "constant",
    "crepa_self_flow_mask_ratio": 0.1,
    "crepa_similarity_ema_decay": 0.99,
    "crepa_spatial_align": True,
    "crepa_threshold_mode": "permanent",
    "data_aesthetic_score": 7.0,
    "data_backend_sampling": "auto-weighting",
    "flow_beta_schedule_alpha": 2.0,
    "flow_beta_schedule_beta": 2.0,
    "flow_timesteps_mode": "fixed-list",
    "freeze_encoder_after": 17,
    "freeze_encoder_before": 12,
    "freeze_encoder_strategy": "after",
    "ideogram_auto_json": True,
    "ideogram_prompt_enhancer_head_id": "diffusers/qwen3-vl-8b-instruct-lm-head",
    "ideogram_schedule_std": 1.5,
    "internal_guidance_loss_weight": 0.5,
    "irepa_projector_kernel_size": 3,
    "irepa_spatial_norm_alpha": 0.6,
    "layersync_lambda": 0.2,
    "ltx_i2v_prob": 0.1,
    "ltx_partial_noise_fraction": 0.05,
    "ltx_train_mode": "i2v",
    "minimax_h3_sparse_attention": "disabled",
    "minimax_h3_sparse_block_shape": "1,8,16",
    "minimax_h3_sparse_video_kv_fraction": 0.5,
    "minimax_h3_target_mode": "auto",
    "minimax_music_lm_adapter_strength": 1.0,
    "minimax_music_lm_precache_mode": "text-only",
    "minimax_music_train_component": "transformer",
    "mixflow_gamma": 0.8,
    "nextlat_block_index": -1,
    "nextlat_state_loss": "smooth_l1",
    "nsfw_check_backend_types": "all",
    "nsfw_check_min_votes": 2,
    "nsfw_check_sample_types": "image,conditioning",
    "nsfw_check_video_frame_count": 3,
    "nsfw_check_video_frame_selection": "uniform",
    "nsfw_check_video_min_flagged_frames": 1,
    "peft_lora_mode": "standard",
    "pretrained_transformer_subfolder": "transformer",
    "pretrained_unet_subfolder": "unet",
    "refiner_training_strength": 0.2,
    "sageattention_usage": "inference",
    "scheduled_sampling_order": 2,
    "scheduled_sampling_prob_end": 0.5,
    "scheduled_sampling_ramp_shape": "linear",
    "scheduled_sampling_reflexflow_alpha": 1.0,
    "scheduled_sampling_reflexflow_beta1": 10.0,
    "scheduled_sampling_reflexflow_beta2": 1.0,
    "scheduled_sampling_sampler": "unipc",
    "scheduled_sampling_strategy": "uniform",
    "sd3_clip_uncond_behaviour": "empty_string",
    "snr_weight": 1.0,
    "t5_padding": "unmodified",
    "text_encoder_limit": 100,
    "timestep_bias_end": 1000,
    "timestep_bias_multiplier": 1.0,
    "timestep_bias_portion": 0.25,
    "urepa_encoder_image_size": 518,
    "urepa_lambda": 0.5,
    "urepa_manifold_weight": 3.0,
    "urepa_model": "dinov2_vitg14",
    "urepa_power": 1.0,
    "urepa_scheduler": "constant",
    "urepa_similarity_ema_decay": 0.99,
    "urepa_threshold_mode": "permanent",
    "xm_candidate_count": 1,
    "xm_selection_scope": "sample",
    "xm_training_target": "noise",
}
