"""How the op's Mosaic GPU kernels are launched: the one kernel form they all share."""

from jax.experimental.pallas import mosaic_gpu as plgpu


def mosaic_kernel(body, *, name: str, out_type, scratch_types, grid: tuple[int, ...],
                  grid_names: tuple[str, ...], interpret):
  """`plgpu.kernel(body, ...)`: a Mosaic GPU kernel in lane semantics without automatic
  barriers.

  Each caller's body orders its own shared-memory accesses (barrier waits after TMA copies,
  commit_smem before the tensor cores or a copy out read what threads stored), which is what
  makes leaving out Pallas' barriers safe; each says how at its call.
  interpret: False (compiled), True, or the interpreter's parameters
  (`plgpu.InterpretGPUParams`, e.g. with detect_races).
  """
  if isinstance(interpret, bool):
    interpret = plgpu.InterpretGPUParams() if interpret else None
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                           unsafe_no_auto_barriers=True),
      interpret=interpret, kernel_name=name)
