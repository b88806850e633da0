r"""Samples text from a language-model checkpoint, printing it as it is decoded.

  python generate.py --checkpoint runs/lm --prompt "The history of" --max_new_tokens 64
  python generate.py --checkpoint runs/lm --prompt "" --temperature 0.8 --top_p 0.95 --num_samples 4
  python generate.py --checkpoint runs/conv --prompt_file prompts.txt --temperature 0

--checkpoint: a train.py workdir (latest step), one of its checkpoints/<step> folders, or a
conversion output. Each prompt starts with EOS, as every training document does; a sample ends
at its first EOS or after --max_new_tokens. The text goes to stdout, its control characters
other than newlines and tabs escaped (\x07), the timing (tokens/s) to stderr. See
palimpsa_jax/evaluation/generation.py.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from palimpsa_jax.evaluation import generation
from palimpsa_jax.evaluation import lm as lm_lib
from palimpsa_jax.run_config import values
from palimpsa_jax import user_errors

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A workdir, one of its checkpoints/<step> folders, or a conversion output.")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt (may be empty).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A UTF-8 text file, one prompt per line.")
_SAMPLING = {  # the flag of each generation.Sampling setting, checked by its field
    name: define(name, generation.SAMPLING_FIELDS[name].default, help_text)
    for name, define, help_text in [
        ("max_new_tokens", flags.DEFINE_integer, "Most new tokens per sample."),
        ("temperature", flags.DEFINE_float, "Sampling temperature; 0 is greedy."),
        ("top_k", flags.DEFINE_integer, "Sample among the k most likely tokens; 0: all."),
        ("top_p", flags.DEFINE_float, "Nucleus sampling mass in (0, 1]; 1: all."),
        ("seed", flags.DEFINE_integer, "Sampling seed (the same seed gives the same text)."),
        ("num_samples", flags.DEFINE_integer, "Samples per prompt, decoded as one batch.")]}
for _name, _holder in _SAMPLING.items():
  values.check_flag(_holder, generation.SAMPLING_FIELDS[_name])


def _prompts() -> list[str]:
  if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
    raise app.UsageError("give exactly one of --prompt and --prompt_file.")
  if _PROMPT_FILE.value is not None:
    return generation.read_prompt_file(_PROMPT_FILE.value)
  return [_PROMPT.value]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if logging.get_verbosity() == logging.INFO:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO.
  prompts = _prompts()
  model, _, _, tokenizer = lm_lib.load_checkpoint(_CHECKPOINT.value)
  sampling = generation.Sampling(**{name: flag.value for name, flag in _SAMPLING.items()})

  def write(text):
    sys.stdout.write(generation.printable(text))
    sys.stdout.flush()

  timings = []
  for index, prompt in enumerate(prompts):
    if len(prompts) > 1:
      write(f"=== prompt {index + 1}/{len(prompts)} ===\n")
    if sampling.num_samples == 1:
      write(prompt)
    _, timing = generation.sample(model, tokenizer, prompt, sampling, write)
    timings.append(timing)
    if sampling.num_samples == 1:
      write("\n")
  print(generation.timing_line(timings), file=sys.stderr)


if __name__ == "__main__":
  flags.mark_flag_as_required("checkpoint")
  user_errors.run_app("generate.py", main)
