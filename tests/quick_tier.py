"""The quick tier (`pytest -m quick`): a few minutes on 2 cores, and still a proof of
each package's core equivalences. Listed here, in one place, by what each entry proves;
`conftest.pytest_collection_modifyitems` marks them. An entry is a test's node id, or a
node-id prefix that selects every parameter of a test or every test of a file."""

QUICK = (
  # The layout: imports point down; the config lists every knob and validates.
  'tests/test_layering.py',
  'tests/test_configs.py::test_model_config_is_frozen_hashable_and_validated',
  'tests/test_configs.py::test_execution_fields_are_few_and_removed_ones_name_their_replacement',
  'tests/test_modes.py',
  # The method, stated plainly, against every fast read and the Transformer (E0-E3).
  'tests/residuals/test_method.py::test_one_shot_read_equals_the_method',
  'tests/residuals/test_method.py::test_block_size_one_is_full',
  'tests/residuals/test_method.py::test_the_methods_two_phase_schedule_is_its_one_shot_read',
  'tests/residuals/test_method.py::test_transformer_equals_the_method[block-2]',
  'tests/residuals/test_depth.py::test_block_bookkeeping_matches_design',
  'tests/residuals/test_depth.py::test_full_is_block_size_one',
  # The model: the literal method, E1 (S = 1 is Full), E2 (zero queries = standard),
  # scan = unrolled, causality.
  'tests/models/test_model.py::test_matches_the_literal_method',
  'tests/models/test_model.py::test_e1_block_size_one_equals_full',
  'tests/models/test_model.py::test_e2_zero_queries_match_the_standard_model',
  'tests/models/test_model.py::test_causal',
  # A user's own layers (3 sublayers a layer) in a DepthStack: gradients = the method.
  'tests/models/test_depth_stack.py::test_gradients_equal_the_methods_one_shot_reads[block-2]',
  # The two-phase schedule equals the one-shot read (E3), values and gradients.
  'tests/residuals/test_two_phase.py::test_phases_equal_the_one_shot_read',
  'tests/residuals/test_two_phase.py::test_phase2_gradients_equal_autodiff',
  # The linear-memory backward equals autodiff (E5), one case.
  'tests/residuals/test_memory.py::test_linear_memory_backward_equals_plain_autodiff[block-2-0-none]',
  # The layer stack: scanned = an unrolled loop, the layer contract checked (E4).
  'tests/nn/test_stack.py',
  # The kernels: Phase 1 in Pallas (interpret mode) equals XLA.
  'tests/kernels/test_depth_pallas.py::test_all_slots_valid_and_a_single_query',
  # Attention: splash (interpret mode) equals XLA; the CPU default is today's call.
  'tests/kernels/test_attention.py::test_splash_in_interpret_mode_equals_xla[136-float32]',
  'tests/kernels/test_attention.py::test_auto_on_the_cpu_is_todays_xla_call_bit_for_bit',
  # Remat: 'minimal' computes 'none' bit for bit and keeps the named matmul outputs.
  'tests/nn/test_remat.py::test_every_policy_computes_the_loss_and_gradients_of_none[standard-minimal]',
  'tests/nn/test_remat.py::test_minimal_keeps_the_named_matmul_outputs_and_not_the_scores',
  # The comparators: HC and mHC equal the papers' equations.
  'tests/residuals/test_hyper_connections.py::test_matches_the_papers_equations[hc-True]',
  'tests/residuals/test_hyper_connections.py::test_matches_the_papers_equations[mhc-True]',
  # The residual interface: a toy residual through the stack; plug-ins.
  'tests/residuals/test_residual.py::test_a_residual_written_against_the_interface_runs_through_the_stack',
  # The pipeline's plan reproduces the paper's counts.
  'tests/parallel/test_pipeline_plan.py::test_transfer_plan_counts_are_the_papers_eqs_7_and_8_at_one_block_per_chunk',
  'tests/parallel/test_pipeline_plan.py::test_transfer_plan_reproduces_the_papers_figure_3',
  # Training: the step is AdamW computed directly, weight decay spares the right ones.
  'tests/training/test_train_step.py::test_train_step_matches_direct_adamw_computation',
  'tests/training/test_train_step.py::test_weight_decay_mask_excludes_exactly_norms_queries_gains',
  # Data: validation is held-out plays, every validation byte scored once.
  'tests/data/test_data.py::test_validation_is_the_held_out_plays',
  'tests/data/test_data.py::test_no_held_out_text_in_training',
  # Evaluation: the metrics equal a direct computation; depth weights are a softmax.
  'tests/evaluation/test_eval.py::test_metrics_equal_direct_computation',
  'tests/evaluation/test_eval.py::test_depth_weight_rows_sum_to_one',
  # Decoding: chunked prefill equals one-shot prefill.
  'tests/inference/test_decode.py::test_chunked_prefill_equals_one_shot_prefill',
  # Runs: the lock is exclusive; a stop signal is caught once.
  'tests/runs/test_reliability.py::test_lock_is_exclusive_released_and_recorded',
  'tests/runs/test_reliability.py::test_stop_signal_catches_the_first_signal_and_restores_the_handlers',
)


def is_quick_by(entry: str, nodeid: str) -> bool:
  """Whether `entry` selects `nodeid`: itself, a parameter of it, or a test of it."""
  return nodeid == entry or nodeid.startswith((entry + '[', entry + '::'))


def is_quick(nodeid: str) -> bool:
  return any(is_quick_by(entry, nodeid) for entry in QUICK)
