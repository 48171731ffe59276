"""Subword: the default model on the embedded plays with a SentencePiece tokenizer.

  python train.py --config=configs/subword.py --workdir=workdirs/subword
  python train.py --config=configs/subword.py:bytes --workdir=workdirs/bytes

The tokenizer (1024 pieces) is trained on the whole training split on first use (~10 s)
and copied into the workdir. It covers 2.29 bytes per token of the training split, so
a 56-token window holds the 128 bytes of the default byte run's window: same model,
batch and steps, the same bytes seen (16 x 56 x 2.29 = 2,050 per step vs 2,048), and
about 2.3x fewer tokens to compute. Compare them by held-out bits per byte; `:bytes`
is the matching byte run (configs/default.py). `--config.data.vocab_size=N` changes
the model's vocabulary with it (then adjust seq_len to keep the bytes).
"""

import ml_collections

from configs import default

VOCAB_SIZE = 1024
SEQ_LEN = 56  # ~128 bytes at 2.29 bytes per token


def get_config(arg: str = 'subword') -> ml_collections.ConfigDict:
  if arg not in ('subword', 'bytes'):
    raise ValueError(f"configs/subword.py:<arg> must be 'subword' or 'bytes', got "
                     f'{arg!r}.')
  config = default.get_config()
  if arg == 'bytes':
    return config
  config.data.tokenizer = 'sentencepiece'
  config.data.vocab_size = VOCAB_SIZE
  config.model.vocab_size = config.data.get_ref('vocab_size')  # follows overrides
  config.train.seq_len = SEQ_LEN
  return config
