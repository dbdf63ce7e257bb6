"""Numerics in one home: everything that decides in which dtype and at which scale a step computes, used alike by
the 1-process reference (framework/train/local_engine.py) and the parallel recipe and engine
(framework/parallel/parallelize.py, framework/train/parallel_engine.py), so the reference cannot drift from the
layouts it checks on exactly the features that change numerics.

  precision.py   the dtype table, autocast, the one fp16 loss scaler, the shared end of an optimizer step
  transforms.py  the one ordered list of model transforms (compile; FP8 and later ones register beside it),
                 applied by `LocalEngine` and by `parallelize` at the same point of building a model
"""
