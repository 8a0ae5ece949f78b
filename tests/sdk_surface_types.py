"""The registry's rows for the request types the clients' methods take (see sdk_registry.py)."""

from __future__ import annotations

from sdk_registry import (
    LOSSES,
    PARITY,
    REST,
    S038,
    SAMPLING,
    SDK,
    add,
    method,
    options,
    probe,
    refused,
    values,
    works,
)

SESSIONS = works(REST + "test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records")
# ---- request types ----
SEARCH = SESSIONS.tests[0]
method(
    "SessionSearchRequest",
    "session_id",
    works(SEARCH, probe("search")),
)
options("SessionSearchRequest", "project_ids display_name owner statuses limit cursor", works(SEARCH))
add(works(probe("search_filters")), "SessionSearchRequest.user_metadata")
method("UserSearchOwner", "owner_urns", works(SEARCH))
add(works(SEARCH), "AccessibleSearchOwner")
method("ClientFinishedSessionStatusQuery", "reasons", works(SEARCH))
method(
    "SessionSearchCursor",
    "last_created_at last_session_id",
    works(probe("search_filters"), note="the cursor a search answers, rebuilt from its fields"),
)
add(
    works(probe("search_filters")),
    "OwnSearchOwner",
    "ActiveSessionStatusQuery",
    "CancelledSessionStatusQuery",
    "FailedSessionStatusQuery",
)
add(works(probe("create_adam", "from_state_adam")), "AdamOptimizerConfig")
method(
    "AdamParams",
    "learning_rate",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("adam_fields")),
)
options(
    "AdamParams",
    "beta1 beta2 eps weight_decay grad_clip_norm",
    works(PARITY + "test_adam_defaults_are_the_sdk_s_and_reach_the_optimizer", probe("adam_fields")),
)
DIMUON = works(
    LOSSES + "test_a_dimuon_client_steps_along_the_momentum_s_matrix_sign_and_refuses_adam_steps",
    LOSSES + "test_dimuon_state_resumes_through_the_sdk_and_keeps_its_family",
    probe("create_dimuon"),
    note="the update as the Tinker parity page's Dimuon section infers it; an Adam step on a Dimuon "
    "model, or a Dimuon step on an AdamW one, fails naming the families and changes nothing",
)
add(DIMUON, "DimuonOptimizerConfig", "DimuonParams")
options("DimuonParams", "learning_rate beta1", DIMUON)
options("DimuonParams", "grad_clip_norm", works(probe("create_dimuon")))
method(
    "Datum",
    "model_input loss_fn_inputs",
    works(
        SDK + "test_losses_match_plain_torch",
        LOSSES + "test_soft_targets_dense_and_sparse_score_and_train_a_teacher_s_top_k",
    ),
)
PROVENANCE = works(
    SAMPLING + "test_provenance_spans_are_checked_against_what_the_engine_sampled",
    SAMPLING + "test_stable_reinforce_uses_the_stability_information_recorded_per_sequence",
)
add(PROVENANCE, "Datum.model_input_spans", "Datum.loss_fn_input_spans")
for _span in ("PromptProvenanceSpan", "SampledProvenanceSpan"):
    method(_span, "sequence_id offset length", PROVENANCE)
method(
    "ModelInput",
    "",
    works(SDK + "test_train_save_sample_and_resume_with_optimizer", probe("model_input_chunks")),
)
options("ModelInput", "chunks", works(probe("model_input_chunks")))
method("EncodedTextChunk", "tokens", works(PARITY + "test_sampling_defaults_are_the_sdk_s"))
MULTIMODAL = refused(
    "the engine's models read text only: a prompt with an image or dmel chunk is refused naming the "
    "chunk's type",
    probe("image_chunks"),
)
method("ImageChunk", "data format expected_tokens", MULTIMODAL)
method("ImageAssetPointerChunk", "format location expected_tokens", MULTIMODAL)
method("DmelChunk", "dmel", MULTIMODAL)
values("ImageChunk.format", "png jpeg", MULTIMODAL)
values("ImageAssetPointerChunk.format", "png jpeg", MULTIMODAL)
method("SamplingParams", "max_tokens seed stop", works(SDK + "test_sampling_seed_and_stops", probe("sample")))
add(
    works(S038 + "test_topk_sample_logprobs_are_the_sampled_positions_distribution", probe("greedy")),
    "SamplingParams.temperature",
)
add(
    works(PARITY + "test_sampling_defaults_are_the_sdk_s", probe("greedy")),
    "SamplingParams.top_k",
    "SamplingParams.top_p",
)
method(
    "TensorData",
    "data dtype shape sparse_crow_indices sparse_col_indices",
    works(
        S038 + "test_sparse_target_prompt_logprobs_answer_the_listed_cells_in_the_same_layout",
        LOSSES + "test_soft_targets_dense_and_sparse_score_and_train_a_teacher_s_top_k",
    ),
)
values(
    "TensorData.dtype",
    "int64 float32",
    works(S038 + "test_sparse_target_prompt_logprobs_answer_the_listed_cells_in_the_same_layout"),
)
