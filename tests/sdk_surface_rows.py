"""The registry's rows for the clients' methods and their options (see sdk_registry.py)."""

from __future__ import annotations

from sdk_registry import (
    COOKBOOK,
    EXTERNAL,
    LOSSES,
    MEMORY,
    PARITY,
    REST,
    S038,
    SAMPLING,
    SDK,
    SNAPSHOTS,
    Entry,
    add,
    method,
    options,
    probe,
    refused,
    values,
    works,
)

# ---- ServiceClient ----
method(
    "ServiceClient",
    "user_metadata project_id display_name base_url api_key",
    works(
        REST + "test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records",
        probe("copy_weights"),
    ),
)
add(works(probe("service_headers")), "ServiceClient(default_headers_overrides)")
method(
    "ServiceClient.create_lora_training_client",
    "base_model rank seed",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("create_lora")),
)
options(
    "ServiceClient.create_lora_training_client",
    "train_mlp train_attn train_unembed",
    works(probe("create_lora_parts")),
)
add(works(probe("create_lora_metadata")), "ServiceClient.create_lora_training_client(user_metadata)")
add(
    works(
        LOSSES + "test_a_dimuon_client_steps_along_the_momentum_s_matrix_sign_and_refuses_adam_steps",
        probe("create_adam", "create_dimuon"),
    ),
    "ServiceClient.create_lora_training_client(optimizer)",
)
method(
    "ServiceClient.create_sampling_client",
    "model_path base_model",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", SDK + "test_sampling_seed_and_stops"),
)
add(works(probe("sampler_retry")), "ServiceClient.create_sampling_client(retry_config)")
add(works(probe("stability")), "ServiceClient.create_sampling_client(record_stability_info)")
method(
    "ServiceClient.create_training_client_from_state",
    "path",
    works(
        SDK + "test_train_save_sample_and_resume_with_optimizer",
        SDK + "test_bad_inputs_fail_clearly_and_change_nothing",
    ),
)
options(
    "ServiceClient.create_training_client_from_state",
    "base_model user_metadata",
    works(REST + "test_create_via_load_makes_a_new_model_and_nothing_else", probe("from_state_options")),
)
add(
    works(
        LOSSES + "test_dimuon_state_resumes_through_the_sdk_and_keeps_its_family", probe("from_state_adam")
    ),
    "ServiceClient.create_training_client_from_state(optimizer)",
)
WEIGHTS_ACCESS_TOKEN = refused(
    "weights_access_token reads another organisation's weights; a local engine has one organisation, so "
    "it is a 400 naming the field",
    REST + "test_create_via_load_makes_a_new_model_and_nothing_else",
    REST + "test_copy_weights_refuses_bad_requests_and_answers_a_retry_once",
    probe("access_token"),
)
add(
    WEIGHTS_ACCESS_TOKEN,
    "ServiceClient.create_training_client_from_state(weights_access_token)",
    "ServiceClient.create_training_client_from_state_with_optimizer(weights_access_token)",
    "ServiceClient.copy_weights(weights_access_token)",
    "RestClient.copy_weights(weights_access_token)",
    "TrainingClient.load_state(weights_access_token)",
    "TrainingClient.load_state_with_optimizer(weights_access_token)",
)
method(
    "ServiceClient.create_training_client_from_state_with_optimizer",
    "path",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("from_state_optimizer")),
)
options(
    "ServiceClient.create_training_client_from_state_with_optimizer",
    "base_model user_metadata",
    works(probe("from_state_optimizer")),
)
method(
    "ServiceClient.copy_weights",
    "path ttl_seconds",
    works(REST + "test_copy_weights_makes_a_run_sharing_the_sources_bytes", probe("copy_weights")),
)
method(
    "ServiceClient.create_custom_loss",
    "fn input_ranks",
    works(
        probe("custom_loss"),
        note="the engine does not take uploaded losses (its client config leaves custom_loss_server_side "
        "off), so the SDK runs the traced loss client-side: a forward, then its gradient as weights",
    ),
)
add(works(probe("service_misc")), "ServiceClient.create_rest_client", "ServiceClient.get_console_url")
add(
    Entry("works", probe("service_misc"), "the SDK's own telemetry: TINKER_TELEMETRY=0 turns it off"),
    "ServiceClient.get_telemetry",
)
add(
    works(probe("capabilities"), COOKBOOK + "test_tinker_sdk_reaches_the_engine_from_the_environment"),
    "ServiceClient.get_server_capabilities",
)
method(
    "ServiceClient.close",
    "status detail",
    works(
        REST + "test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records", probe("close")
    ),
)
values("ServiceClient.close(status", "success interrupted", works(probe("close")))
values(
    "ServiceClient.close(status",
    "errored",
    works(REST + "test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records"),
)

# ---- TrainingClient ----
LOSS_TESTS = (
    SDK + "test_losses_match_plain_torch",
    PARITY + "test_gspo_and_stable_reinforce_train_through_the_tinker_sdk",
)
for _name in ("TrainingClient.forward", "TrainingClient.forward_backward"):
    method(_name, "data loss_fn", works(*LOSS_TESTS, probe("loss_ppo")))
    options(_name, "loss_fn_config", works(probe("loss_ppo", "loss_dro", "loss_stable_reinforce")))
    values(
        _name + "(loss_fn", "cross_entropy", works(SDK + "test_losses_match_plain_torch", probe("forward"))
    )
    values(_name + "(loss_fn", "ppo", works(SDK + "test_losses_match_plain_torch", probe("loss_ppo")))
    values(_name + "(loss_fn", "gspo", works(LOSS_TESTS[1], probe("loss_gspo")))
    values(_name + "(loss_fn", "stable_reinforce", works(LOSS_TESTS[1], probe("loss_stable_reinforce")))
    for _loss in ("importance_sampling", "cispo", "dro"):
        values(_name + "(loss_fn", _loss, works(probe(f"loss_{_loss}")))
    values(
        _name + "(loss_fn",
        "custom",
        refused(
            "'custom' runs a loss uploaded by create_custom_loss on the server; the engine takes no "
            "uploads (its client config says so, and the SDK runs such losses client-side), so a "
            "'custom' request is refused naming it and changes nothing",
            probe("custom_loss_fn"),
        ),
    )
method(
    "TrainingClient.forward_backward_custom",
    "data loss_fn",
    works(
        LOSSES + "test_a_custom_loss_over_a_target_distribution_gets_and_trains_n_by_k_logprobs",
        COOKBOOK + "test_decision_model_scores_with_target_prompt_logprobs_and_trains_on_soft_labels",
        probe("custom_callable"),
    ),
)
options("TrainingClient.forward_backward_custom", "loss_type_input", works(probe("custom_callable")))
method(
    "TrainingClient.optim_step",
    "optim_params adam_params",
    works(probe("adam_keyword")),
)
method(
    "TrainingClient.save_state",
    "name",
    works(
        SDK + "test_train_save_sample_and_resume_with_optimizer",
        SDK + "test_bad_inputs_fail_clearly_and_change_nothing",
    ),
)
add(works(MEMORY + "test_ttl_seconds_expire_checkpoints"), "TrainingClient.save_state(ttl_seconds)")
add(
    works(probe("save_state")),
    "TrainingClient.save_state(overwrite)",
    "TrainingClient.save_state(user_metadata)",
)
method(
    "TrainingClient.save_weights_for_sampler",
    "name",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer"),
)
add(works(probe("save_sampler")), "TrainingClient.save_weights_for_sampler(ttl_seconds)")
add(works(probe("save_sampler")), "TrainingClient.save_weights_for_sampler(user_metadata)")
add(
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("snapshot")),
    "TrainingClient.save_weights_and_get_sampling_client",
)
options(
    "TrainingClient.save_weights_and_get_sampling_client",
    "name retry_config",
    works(
        probe("snapshot_options"),
        note="`name` is deprecated by the SDK as having no effect: the snapshot stays unnamed",
    ),
)
add(
    works(SAMPLING + "test_stable_reinforce_uses_the_stability_information_recorded_per_sequence"),
    "TrainingClient.save_weights_and_get_sampling_client(record_stability_info)",
)
add(
    works(SAMPLING + "test_an_inflight_sampling_client_follows_the_weights_saved_later", probe("inflight")),
    "TrainingClient.save_weights_and_get_sampling_client(kind)",
)
values(
    "TrainingClient.save_weights_and_get_sampling_client(kind",
    "snapshot",
    works(
        SNAPSHOTS + "test_an_older_sampling_client_samples_after_a_newer_snapshot_until_its_session_ends",
        probe("snapshot"),
    ),
)
values(
    "TrainingClient.save_weights_and_get_sampling_client(kind",
    "inflight",
    works(SAMPLING + "test_an_inflight_sampling_client_follows_the_weights_saved_later"),
)
method(
    "TrainingClient.create_sampling_client",
    "model_path retry_config",
    works(probe("tc_sampler")),
)
options(
    "TrainingClient.create_sampling_client",
    "record_stability_info",
    works(probe("stability")),
)
method(
    "TrainingClient.save_weights_external",
    "name ttl_seconds",
    works(
        EXTERNAL + "test_export_is_a_loadable_adapter_equal_to_the_sampler_weights",
        EXTERNAL + "test_export_errors_listing_and_deletion",
    ),
)
add(
    works(REST + "test_age_encrypted_external_weights_decrypt_to_the_plain_export"),
    "TrainingClient.save_weights_external(age_encryption_recipients)",
)
add(works(probe("load_state")), "TrainingClient.load_state", "TrainingClient.load_state(path)")
add(
    works(probe("load_state")),
    "TrainingClient.load_state_with_optimizer",
    "TrainingClient.load_state_with_optimizer(path)",
)
add(
    works(probe("tc_misc")),
    "TrainingClient.get_info",
    "TrainingClient.get_tokenizer",
    "TrainingClient.get_console_url",
)
add(Entry("works", probe("tc_misc"), "the SDK's own telemetry"), "TrainingClient.get_telemetry")

# ---- SamplingClient ----
method(
    "SamplingClient.sample",
    "prompt num_samples sampling_params",
    works(SDK + "test_sampling_seed_and_stops", SDK + "test_concurrent_samples_are_batched", probe("sample")),
)
add(
    works(S038 + "test_target_prompt_logprobs_are_the_prompts_logprobs_of_those_ids", probe("prompt_lp")),
    "SamplingClient.sample(include_prompt_logprobs)",
)
add(
    works(
        S038 + "test_topk_sample_logprobs_are_the_sampled_positions_distribution",
        S038 + "test_topk_logprobs_out_of_range_are_refused_naming_the_field",
    ),
    "SamplingClient.sample(topk_sample_logprobs)",
)
add(
    works(
        S038 + "test_topk_sample_logprobs_are_the_sampled_positions_distribution",
        S038 + "test_topk_logprobs_out_of_range_are_refused_naming_the_field",
        COOKBOOK + "test_off_policy_distillation_learns_a_teacher_s_top_k",
    ),
    "SamplingClient.sample(topk_prompt_logprobs)",
)
add(
    works(
        S038 + "test_target_prompt_logprobs_are_the_prompts_logprobs_of_those_ids",
        S038 + "test_sparse_target_prompt_logprobs_answer_the_listed_cells_in_the_same_layout",
        S038 + "test_bad_target_prompt_logprobs_are_refused_naming_the_field",
        COOKBOOK + "test_decision_model_scores_with_target_prompt_logprobs_and_trains_on_soft_labels",
    ),
    "SamplingClient.sample(target_prompt_logprobs)",
)
add(
    works(
        SAMPLING + "test_prompt_alt_tokens_are_k_draws_per_prompt_position_with_their_logprobs",
        SAMPLING + "test_prompt_alt_tokens_follow_the_requests_temperature",
        SAMPLING + "test_prompt_alt_tokens_k_out_of_range_is_refused_naming_the_field",
    ),
    "SamplingClient.sample(prompt_alt_tokens_k)",
)
add(works(probe("last_n")), "SamplingClient.sample(prompt_logprobs_last_n)")
method(
    "SamplingClient.compute_logprobs",
    "prompt",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("prompt_lp")),
)
add(works(probe("last_n")), "SamplingClient.compute_logprobs(prompt_logprobs_last_n)")
method(
    "SamplingClient.create",
    "holder model_path base_model sampling_session_id retry_config record_stability_info",
    works(probe("sampling_create"), note="the SDK's own factory behind every create_sampling_client"),
)
method("SamplingClient.from_sampler_handle", "handle api_key", works(probe("handle")))
add(works(probe("handle")), "SamplingClient.get_sampler_handle")
add(works(probe("sampler_misc")), "SamplingClient.get_base_model", "SamplingClient.get_tokenizer")
add(Entry("works", probe("sampler_misc"), "the SDK's own telemetry"), "SamplingClient.get_telemetry")
method(
    "SamplingClient.on_queue_state_change",
    "queue_state queue_state_reason",
    works(
        probe("queue_state"),
        note="the SDK's callback for the queue state a server reports while it holds requests back; the "
        "engine queues and reports nothing, so the SDK never calls it against the engine",
    ),
)

# ---- RestClient and AdminClient ----
for _owner in ("RestClient", "AdminClient"):
    method(
        _owner,
        "base_url api_key",
        works(
            REST + "test_whoami_reads_a_token_that_only_the_key_gets",
            REST + "test_admin_calls_answer_from_the_engines_own_records",
        ),
    )
    ADMIN = works(REST + "test_admin_calls_answer_from_the_engines_own_records", probe(f"{_owner}_audit_log"))
    method(f"{_owner}.get_audit_log", "event_type day", ADMIN)
    values(f"{_owner}.get_audit_log(event_type", "all checkpoints", ADMIN)
    values(f"{_owner}.get_audit_log(event_type", "projects", works(probe(f"{_owner}_audit_log")))
    values(
        f"{_owner}.get_audit_log(event_type",
        "teams",
        works(ADMIN.tests, note="a local engine has no team or organisation events: an empty log"),
    )
    values(
        f"{_owner}.get_audit_log(event_type",
        "organizations",
        works(probe(f"{_owner}_audit_log"), note="no organisation events either: an empty log"),
    )
    method(
        f"{_owner}.get_billing_usage",
        "starting_on ending_before",
        works(
            REST + "test_admin_calls_answer_from_the_engines_own_records",
            probe(f"{_owner}_billing_usage"),
            note="a local engine costs nothing: no usage lines",
        ),
    )
    method(
        f"{_owner}.get_current_checkpoint_storage_usage",
        "project_id",
        works(
            REST + "test_admin_calls_answer_from_the_engines_own_records", probe(f"{_owner}_storage_usage")
        ),
    )
    add(Entry("works", probe("telemetry"), "the SDK's own telemetry"), f"{_owner}.get_telemetry")

method(
    "RestClient.copy_weights",
    "path destination_project_id ttl_seconds",
    works(
        REST + "test_copy_weights_makes_a_run_sharing_the_sources_bytes",
        REST + "test_copy_weights_refuses_bad_requests_and_answers_a_retry_once",
    ),
)
for _name in (
    "RestClient.publish_checkpoint_from_tinker_path",
    "RestClient.unpublish_checkpoint_from_tinker_path",
):
    method(_name, "tinker_path", works(REST + "test_publish_and_unpublish_flip_public_and_refuse_repeats"))
SESSIONS = works(REST + "test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records")
method("RestClient.list_sessions", "limit", works(SESSIONS.tests[0], probe("sessions")))
options("RestClient.list_sessions", "offset access_scope", works(probe("sessions")))
values("RestClient.list_sessions(access_scope", "owned accessible", works(probe("sessions")))
method("RestClient.get_session", "session_id", works(SESSIONS.tests[0], probe("sessions")))
options("RestClient.get_session", "access_scope", works(probe("sessions")))
values("RestClient.get_session(access_scope", "owned accessible", works(probe("sessions")))
method("RestClient.search_sessions", "request", SESSIONS)
method("RestClient.assign_session_project", "session_id project_id", SESSIONS)
method("RestClient.export_session_trace", "session_id", SESSIONS)
add(
    works(
        REST + "test_whoami_reads_a_token_that_only_the_key_gets",
        note="the SDK exchanges the key for a JWT at /api/v1/auth/token, as it does with Tinker",
    ),
    "RestClient.whoami",
)
method(
    "RestClient.list_training_runs",
    "limit",
    works(SDK + "test_rest_client_lists_runs_and_deletes_checkpoints", probe("runs")),
)
options("RestClient.list_training_runs", "offset access_scope", works(probe("runs")))
values("RestClient.list_training_runs(access_scope", "owned accessible", works(probe("runs")))
add(
    works(REST + "test_copy_weights_makes_a_run_sharing_the_sources_bytes", probe("project_trace")),
    "RestClient.list_training_runs(project_id)",
)
method(
    "RestClient.get_training_run",
    "training_run_id",
    works(SDK + "test_rest_client_lists_runs_and_deletes_checkpoints", probe("run")),
)
for _name in ("RestClient.get_training_run", "RestClient.get_training_run_by_tinker_path"):
    options(_name, "access_scope", works(probe("run", "run_accessible")))
    values(_name + "(access_scope", "owned", works(probe("run")))
    values(_name + "(access_scope", "accessible", works(probe("run_accessible")))
method("RestClient.get_training_run_by_tinker_path", "tinker_path", works(probe("run")))
method(
    "RestClient.list_checkpoints",
    "training_run_id",
    works(SDK + "test_rest_client_lists_runs_and_deletes_checkpoints", probe("checkpoints")),
)
method("RestClient.list_user_checkpoints", "limit offset", works(probe("checkpoints")))
method(
    "RestClient.delete_checkpoint_from_tinker_path",
    "tinker_path",
    works(SDK + "test_rest_client_lists_runs_and_deletes_checkpoints", probe("delete")),
)
method("RestClient.delete_checkpoint", "training_run_id checkpoint_id", works(probe("delete")))
method("RestClient.set_checkpoint_ttl_from_tinker_path", "tinker_path ttl_seconds", works(probe("ttl")))
method(
    "RestClient.get_weights_info_by_tinker_path",
    "tinker_path",
    works(probe("weights_info", "create_lora_parts")),
)
method("RestClient.get_sampler", "sampler_id", works(probe("get_sampler")))
add(works(probe("rest_capabilities")), "RestClient.get_server_capabilities")
method(
    "RestClient.get_external_weights_urls",
    "tinker_path",
    works(
        EXTERNAL + "test_export_is_a_loadable_adapter_equal_to_the_sampler_weights",
        EXTERNAL + "test_file_urls_are_signed_and_never_leave_the_export",
    ),
)
