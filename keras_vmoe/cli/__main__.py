"""`python -m keras_vmoe.cli` = `keras-vmoe`."""

import sys

from keras_vmoe.cli import main

sys.exit(main())
