"""Loaded at a test rank's start when ``tests/without`` leads its PYTHONPATH
(:func:`tests.helpers.without`): the packages named in ``HORA_TEST_WITHOUT`` (comma-separated)
cannot be imported there, as if they were not installed.

TensorFlow and Keras import whatever optional package they find: JAX (TensorFlow Lite's
converter), scikit-learn (Keras' wrappers), pandas (Keras' data adapters), matplotlib (Keras'
plots).  In the test environment, which installs them all for other tests, that was 4 of
``import tensorflow``'s 10 s, in every rank of every TensorFlow test.  A rank that needs none
of them goes without, as on a machine with TensorFlow alone; each import is optional there
(``try: import ...; except ImportError``).

A name bound to None in ``sys.modules`` is Python's own mark of a module that is not to be
imported: ``import`` raises ModuleNotFoundError, and ``importlib.util.find_spec`` (how
torch looks for optional packages) returns None.
"""
import os
import sys

for _name in filter(None, os.environ.get("HORA_TEST_WITHOUT", "").split(",")):
    sys.modules.setdefault(_name, None)
