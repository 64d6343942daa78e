import shutil
from grouprl.config import config_from_dict
from grouprl.trainer.grpo import GRPOTrainer

def test_make_text(say_task, tmp_path):
    t = say_task(6)
    cfg = t.config("/tmp/runs/text", [{"name": "accuracy"}, {"name": "length", "weight": 0.5, "kwargs": {"target": 1}}],
        **{"trainer.max_steps": 3, "data.val_files": [str(t.data)], "data.val_max_samples": 4, "trainer.val_freq": 1,
           "worker.rollout.val_n": 2, "worker.actor.global_batch_size": 4})
    GRPOTrainer(config_from_dict(cfg)).train()

def test_make_vlm(image_task, tmp_path):
    task = image_task(8, format="llava")
    cfg = {
        "data": {"train_files": [str(task.data)], "val_files": [str(task.data)],
                 "max_response_length": 12, "rollout_batch_size": 2, "val_max_samples": 2},
        "worker": {"actor": {"model": {"model_path": str(task.model), "freeze_vision_tower": True},
                             "optim": {"lr": 1e-3}, "global_batch_size": 2},
                   "rollout": {"n": 3},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 4}}]}},
        "trainer": {"output_dir": "/tmp/runs/vlm", "max_steps": 2, "logger": ["jsonl"],
                    "device": "cpu", "val_freq": 2},
    }
    GRPOTrainer(config_from_dict(cfg)).train()
