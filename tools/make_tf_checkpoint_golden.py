#!/usr/bin/env python3
"""Goldens for bertrain's TensorFlow checkpoint reader, made by TensorFlow and HuggingFace.

Three steps, in two environments (TensorFlow and PyTorch need not share one):

  write   (TensorFlow) writes tests/data/tf_checkpoint/tf_classifier/: a run_classifier.py-style
          checkpoint of a tiny BERT (Google's variable names, adam_m/adam_v slots, global_step 7,
          the classifier's top-level output_weights/output_bias, 3 labels) with
          tf.compat.v1.train.Saver, with its `checkpoint` state file and bert_config.json.
  dump    (TensorFlow) reads every variable of a checkpoint with tf.train.load_checkpoint and
          writes them, named "var.<TF name>", to a golden .safetensors file.
  logits  (PyTorch + transformers) loads the checkpoint with transformers' own
          load_tf_weights_in_bert (its `tensorflow` import served from the dump, i.e. TensorFlow's
          values), runs a fixed input through the model in float64, and adds the inputs and
          logits to the golden file. run_classifier's top-level output_weights/output_bias have
          no place in HF's loader (it would look for model.weight); they are assigned to
          classifier.weight/bias as HF's loader treats output_weights elsewhere (not transposed).

  /opt/tfvenv/bin/python tools/make_tf_checkpoint_golden.py write
  /opt/tfvenv/bin/python tools/make_tf_checkpoint_golden.py dump
  /opt/torchvenv/bin/python tools/make_tf_checkpoint_golden.py logits
"""
import json
import os
import sys
import types

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "tests", "data", "tf_checkpoint")
GOLDEN = os.path.join(ROOT, "tests", "golden", "tf_checkpoint")
CHECKPOINTS = {
    # name: (checkpoint prefix, head)
    "keras_bert_tiny": (os.path.join(DATA, "keras_bert_tiny", "bert_model.ckpt"), "pretraining"),
    "tf_classifier": (os.path.join(DATA, "tf_classifier", "model.ckpt-7"), "classification"),
}
CLASSIFIER_CONFIG = {
    "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 8, "initializer_range": 0.02, "intermediate_size": 16,
    "max_position_embeddings": 16, "num_attention_heads": 2, "num_hidden_layers": 2,
    "type_vocab_size": 2, "vocab_size": 20,
}
NUM_LABELS = 3


def classifier_variables(rng):
    c = CLASSIFIER_CONFIG
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    w = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    ln = lambda: (1.0 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    v = {
        "bert/embeddings/word_embeddings": w(V, H),
        "bert/embeddings/position_embeddings": w(c["max_position_embeddings"], H),
        "bert/embeddings/token_type_embeddings": w(c["type_vocab_size"], H),
        "bert/embeddings/LayerNorm/gamma": ln(),
        "bert/embeddings/LayerNorm/beta": w(H),
    }
    for l in range(c["num_hidden_layers"]):
        p = f"bert/encoder/layer_{l}/"
        for m in ("query", "key", "value"):
            v[p + f"attention/self/{m}/kernel"] = w(H, H)  # [in, out], as tf.layers.dense
            v[p + f"attention/self/{m}/bias"] = w(H)
        v[p + "attention/output/dense/kernel"] = w(H, H)
        v[p + "attention/output/dense/bias"] = w(H)
        v[p + "attention/output/LayerNorm/gamma"] = ln()
        v[p + "attention/output/LayerNorm/beta"] = w(H)
        v[p + "intermediate/dense/kernel"] = w(H, I)
        v[p + "intermediate/dense/bias"] = w(I)
        v[p + "output/dense/kernel"] = w(I, H)
        v[p + "output/dense/bias"] = w(H)
        v[p + "output/LayerNorm/gamma"] = ln()
        v[p + "output/LayerNorm/beta"] = w(H)
    v["bert/pooler/dense/kernel"] = w(H, H)
    v["bert/pooler/dense/bias"] = w(H)
    v["output_weights"] = w(NUM_LABELS, H)  # run_classifier.py: [num_labels, hidden]
    v["output_bias"] = w(NUM_LABELS)
    return v


def write():
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    out = os.path.join(DATA, "tf_classifier")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20261130)
    values = classifier_variables(rng)
    graph = tf.Graph()
    with graph.as_default():
        for name, value in values.items():
            tf.compat.v1.get_variable(name, initializer=tf.constant(value))
            # AdamWeightDecayOptimizer's slots, as run_classifier.py saves them
            tf.compat.v1.get_variable(name + "/adam_m", initializer=tf.constant(0.01 * value))
            tf.compat.v1.get_variable(name + "/adam_v", initializer=tf.constant(1e-4 * value * value))
        tf.compat.v1.get_variable("global_step", initializer=tf.constant(7, dtype=tf.int64))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, os.path.join(out, "model.ckpt"), global_step=7, write_meta_graph=False)
    with open(os.path.join(out, "bert_config.json"), "w") as f:
        json.dump(CLASSIFIER_CONFIG, f, indent=2)
        f.write("\n")
    # The state file names the checkpoint by its absolute path; keep it relative, as TF allows.
    with open(os.path.join(out, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "model.ckpt-7"\nall_model_checkpoint_paths: "model.ckpt-7"\n')
    print("wrote", out, sorted(os.listdir(out)))


def dump():
    import tensorflow as tf
    from safetensors.numpy import save_file
    os.makedirs(GOLDEN, exist_ok=True)
    for name, (prefix, _) in CHECKPOINTS.items():
        reader = tf.train.load_checkpoint(prefix)
        tensors = {"var." + v: np.array(reader.get_tensor(v), order="C")
                   for v in sorted(reader.get_variable_to_shape_map())}
        path = os.path.join(GOLDEN, name + ".safetensors")
        save_file(tensors, path)
        print("dumped", len(tensors), "variables of", prefix, "to", path)


def logits():
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import BertConfig, BertForPreTraining, BertForSequenceClassification
    from transformers.models.bert.modeling_bert import load_tf_weights_in_bert
    for name, (prefix, head) in CHECKPOINTS.items():
        path = os.path.join(GOLDEN, name + ".safetensors")
        g = load_file(path)
        variables = {k[4:]: v for k, v in g.items() if k.startswith("var.")}
        served = {k: v for k, v in variables.items()
                  if head == "pretraining" or k not in ("output_weights", "output_bias")}
        # transformers' loader asks `tensorflow` for the variables: answer with TF's own values.
        fake_tf = types.ModuleType("tensorflow")
        fake_tf.train = types.SimpleNamespace(
            list_variables=lambda p: [(k, list(v.shape)) for k, v in sorted(served.items())],
            load_variable=lambda p, k: served[k])
        sys.modules["tensorflow"] = fake_tf
        cfg_path = os.path.join(os.path.dirname(prefix), "bert_config.json")
        cfg = BertConfig.from_json_file(cfg_path)
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
        if head == "pretraining":
            model = BertForPreTraining(cfg)
        else:
            cfg.num_labels = NUM_LABELS
            model = BertForSequenceClassification(cfg)
        load_tf_weights_in_bert(model, cfg, prefix)
        if head == "classification":
            with torch.no_grad():
                model.classifier.weight.copy_(torch.from_numpy(variables["output_weights"]))
                model.classifier.bias.copy_(torch.from_numpy(variables["output_bias"]))
        model = model.double().eval()
        gen = torch.Generator().manual_seed(7)
        B, T = 2, 8
        ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, 5:] = 0
        ids[1, 5:] = 0
        seg = torch.zeros(B, T, dtype=torch.long)
        seg[:, 4:] = 1
        seg[1, 5:] = 0
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, token_type_ids=seg)
        g.update({"input.input_ids": ids.numpy(), "input.input_mask": mask.numpy(),
                  "input.segment_ids": seg.numpy()})
        if head == "pretraining":
            g["output.prediction_logits"] = out.prediction_logits.numpy()
            g["output.seq_relationship_logits"] = out.seq_relationship_logits.numpy()
        else:
            g["output.logits"] = out.logits.numpy()
        save_file(g, path)
        print("logits of", name, "added to", path)


if __name__ == "__main__":
    steps = {"write": write, "dump": dump, "logits": logits}
    if len(sys.argv) != 2 or sys.argv[1] not in steps:
        sys.exit(__doc__)
    steps[sys.argv[1]]()
