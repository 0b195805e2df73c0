#!/usr/bin/env python
"""Write a layer-skip draft model for ``--speculative-algorithm standalone``.

    python scripts/make_layerskip_draft.py /tmp/smollm2-draft --num-layers 8

keeps the first decoder layers of the default model (or ``--model PATH``) with its final
norm, LM head and tokenizer, as a Hugging Face directory. See
:mod:`radixserve_speculative_standalone.layerskip`.
"""

from radixserve_speculative_standalone.layerskip import main

if __name__ == "__main__":
    main()
