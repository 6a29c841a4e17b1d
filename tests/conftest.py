import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


@pytest.fixture
def tmp(tmp_path):
    return tmp_path
