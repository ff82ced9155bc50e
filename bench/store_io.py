"""Checkpoint save/load throughput to an object store next to a plain upload/download of the same
bytes with the same client (s3fs), measured in the same run (not a test).

    .venv/bin/python bench/store_io.py [--hidden 512 --layers 2 --repeats 2]

Starts moto's S3 server on 127.0.0.1 (the one tests/test_store.py uses), then runs itself under
`torchrun --nproc_per_node=2`: a Llama, FSDP2-sharded, with AdamW state, is saved to and loaded from
s3://bench/run through checkpoint.py (DCP's fsspec writer/reader, the manifest read back and
checksummed, `latest`), and every rank uploads and downloads as many bytes as its shard holds as
one object, streamed through the same client as DCP's writer streams (`fs.open`, 1 MiB writes: a
multipart upload): the limit the protocol is measured against. A local test server
in Python says little about a real store's GB/s; the ratio is what carries over (the manifest's
read-back costs about one download of the whole checkpoint on top of the upload).
"""

import json
import logging
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def serve_and_launch():
    """The launcher: the server in this process, torchrun (running this file) against it."""
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ.update(env)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ["AWS_ENDPOINT_URL_S3"] = f"http://{host}:{port}"
    import s3fs

    s3fs.S3FileSystem().mkdir("bench")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:]]
    code = subprocess.run(cmd).returncode
    server.stop()
    sys.exit(code)


def timed(fn, repeats):
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()  # all ranks start together; the slowest rank's time is what a run waits for
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flag(name, default):
    """--name N from the command line (the launcher passes its flags on)."""
    if f"--{name}" in sys.argv:
        return int(sys.argv[sys.argv.index(f"--{name}") + 1])
    return default


def worker():
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from transformers import GenerationConfig
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    import checkpoint
    import common
    import objstore
    import task

    hidden = flag("hidden", 512)
    repeats = flag("repeats", 2)
    rank, world, device = common.init_distributed(0)
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=flag("layers", 2),
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
    )
    model = common.shard_model(LlamaForCausalLM(config), device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device)).logits.sum().backward()
    optim.step()  # materialise AdamW's state
    local = sum(t.to_local().numel() * t.element_size() for t in model.parameters()) * 3
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)  # bytes of state over all ranks
    gb = total.item() / 1e9
    root = "s3://bench/run"
    checkpoint.resolve(root, "")  # the run lock and run id, as a stage takes them
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    roles = {"model": (model, optim)}
    meta = {"args": {"seed": 0, "max_steps": 10}}  # checkpoint.load refuses a step past it
    hf = (config, tok, GenerationConfig())
    save_s = timed(lambda: checkpoint.save(root, 1, roles, meta, hf, keep_last=1), repeats)
    path = f"{root}/checkpoints/step-00000001"
    load_s = timed(lambda: checkpoint.load(path, roles, meta["args"], []), repeats)
    fs, raw = objstore.fs_of(f"s3://bench/raw-{rank}.bin")
    chunk = os.urandom(1 << 20)

    def upload():
        # streamed as DCP's writer streams (s3fs: a multipart upload), not one PUT of a blob
        with fs.open(raw, "wb") as f:
            for _ in range(local // len(chunk)):
                f.write(chunk)

    def download():
        with fs.open(raw, "rb") as f:
            while f.read(1 << 24):
                pass

    write_s = timed(upload, repeats)
    read_s = timed(download, repeats)
    if rank == 0:
        print(
            f"\nstate: {gb:.2f} GB over {world} ranks (weights + AdamW moments), moto on 127.0.0.1"
        )
        print(f"{'':28}{'GB/s':>8}{'plain s3fs GB/s':>17}{'ratio':>8}")
        save_row = f"{gb / save_s:8.3f}{gb / write_s:17.3f}{write_s / save_s:8.2f}"
        print(f"{'save (checkpoint.save)':28}{save_row}")
        load_row = f"{gb / load_s:8.3f}{gb / read_s:17.3f}{read_s / load_s:8.2f}"
        print(f"{'load (checkpoint.load)':28}{load_row}")
        result = {"state_gb": gb, "save_gb_s": gb / save_s, "upload_gb_s": gb / write_s}
        result.update({"load_gb_s": gb / load_s, "download_gb_s": gb / read_s})
        print("BENCH " + json.dumps({"store": result}), flush=True)
    dist.barrier()  # rank 0 is done before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # usage, not a run
        sys.exit(0)
    if "RANK" in os.environ:
        worker()
    else:
        serve_and_launch()
