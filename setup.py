"""colocate: a torch.distributed GRPO trainer on one or several nodes (vLLM inference ranks + FSDP2 learner ranks)."""
from setuptools import find_packages, setup

setup(
    name="colocate",
    version="0.1.0",
    description="RL trainer for LLM agents in one torchrun job (one node or several): vLLM inference ranks, "
                "FSDP2 LoRA learners, NCCL adapter sync; GRPO, DAPO, Dr.GRPO and GSPO objectives",
    python_requires=">=3.10",
    # kernels/ sits at the top of the repository and installs as colocate.kernels (a top-level
    # `kernels` would shadow the hub-kernels package transformers probes for); benchmarks/ is not
    # installed: it runs from a checkout through scripts/benchmark.py.
    packages=find_packages(include=["colocate", "colocate.*"]) + ["colocate.kernels"],
    package_dir={"colocate.kernels": "kernels"},
    package_data={"colocate.envs.diplomacy": ["states.jsonl"], "colocate.kernels": ["grpo_rows_sm90.cu"]},
    # torch is installed first and separately (see README): a bare requirement may pull CUDA wheels.
    install_requires=[
        "torch>=2.6",
        "transformers>=4.50",
        "peft>=0.14",
        "tokenizers>=0.20",
        "safetensors",
        "pyyaml",
        "tensorboard",
        "numpy",
        "diplomacy==1.1.2",
        "datasets",
        "nvidia-ml-py",
        "psutil",
    ],
    extras_require={
        "vllm": ["vllm==0.25.0"],
        "test": ["pytest", "pytest-timeout", "triton",
                 "llguidance==1.7.6"],  # vLLM 0.25's grammar engine: the grammar tests
        "profile": ["py-spy", "torch-tb-profiler"],
        # metrics.loggers beyond TensorBoard (colocate/trackers.py); CI installs them with [test]
        "trackers": ["wandb>=0.19", "mlflow-skinny>=2.20", "trackio>=0.2"],
    },
    entry_points={"console_scripts": ["colocate = colocate.cli:entry"]},
)
