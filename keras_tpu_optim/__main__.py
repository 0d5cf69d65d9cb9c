"""`python -m keras_tpu_optim`: the package's main job (see keras_tpu_optim/_demo.py)."""

from keras_tpu_optim._demo import main

if __name__ == "__main__":
    raise SystemExit(main())
