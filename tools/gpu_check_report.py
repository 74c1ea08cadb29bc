"""The GPU check's results as one Markdown page: the environment, then each part's table."""

from __future__ import annotations

from typing import Any


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _yes(ok: Any) -> str:
    return "yes" if ok is True else "NO" if ok is False else str(ok)


def _failed(name: str, r: dict[str, Any]) -> list[str]:
    out = [f"**{name} failed**: {r['error']}", ""] if "error" in r else []
    if "mounted_run_error" in r:
        out += [f"**{name} failed on the mount** ({r['mounted_run_error']}); the figures "
                "below are the unmounted path's", ""]
    return out


def environment(env: dict[str, Any]) -> list[str]:
    g = env.get("gpu", {})
    sb, fu, ur, od = (env.get(k, {}) for k in ("sandbox", "fuse", "io_uring", "o_direct"))
    cf = g.get("cufile", {})
    rows = [
        ("GPU", f"{g.get('gpu_name', '?')}" + (f", {g['gpu_memory_gib']} GiB, sm "
                                              f"{g['capability']}" if "capability" in g else "")),
        ("torch / CUDA", f"torch {g.get('torch', '?')} built for CUDA {g.get('torch_cuda')}; "
                         f"runtime {g.get('cuda_runtime', '-')}, driver CUDA "
                         f"{g.get('cuda_driver', '-')} ({g.get('driver', '-')})"),
        ("safetensors", g.get("safetensors", "?")),
        ("Python, CPUs", f"{env.get('python')}, {env.get('cpus')}"),
        ("sandbox", f"{sb.get('runtime', '?')} ({'; '.join(sb.get('hints', []))})"),
        ("FUSE", f"/dev/fuse {'present' if fu.get('dev_fuse') else 'missing'}"
                 + (f", opens: {_yes(fu['dev_fuse_opens'])}" if "dev_fuse_opens" in fu else "")
                 + f"; pyfuse3 {fu.get('pyfuse3') or fu.get('pyfuse3_why')}"
                 + f"; mount: {fu.get('mount', '?')}"),
        ("io_uring", f"kernel: {ur.get('kernel', ur.get('error'))}; mxfs engine: "
                     f"{ur.get('mxfs_engine')}"),
        ("O_DIRECT on the pool's disk", f"{_yes(od.get('works'))}"
                                        + (f" ({od['why']})" if "why" in od else "")
                                        + f", {od.get('filesystem')}"),
        ("cuFile / kvikio", f"kvikio {cf.get('kvikio', '?')}; {cf.get('path', '-')}; "
                            f"nvidia-fs driver: {_yes(cf.get('nvidia_fs_driver'))}; "
                            f"one CuFile read: {cf.get('read', 'not tried')}"),
    ]
    out = ["## Environment", "", "| what | found |", "|---|---|"]
    out += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    return out + [""] + _failed("the GPU probe", g)


def loads(r: dict[str, Any]) -> list[str]:
    out = ["## Model loads", ""] + _failed("the loads", r)
    if "median" not in r:
        return out
    out += [f"{_gib(r['bytes'])} model, {r['pool']}, GB/s, median of "
            f"{len(r['rounds'])}", "", "| arm | cold | warm |", "|---|---:|---:|"]
    out += [f"| {arm} | {v['cold']:.2f} | {v['warm']:.2f} |" for arm, v in r["median"].items()]
    out += ["", f"bytes equal: {', '.join(f'{k} {_yes(v)}' for k, v in r['equal'].items())}; "
            f"cold is cold: {_yes(r.get('cold_is_cold'))}"]
    if "gds_unavailable" in r:
        out.append(f"b_mxfs_gds skipped: {r['gds_unavailable']}")
    out += [f"{arm} skipped: {why}" for arm, why in r.get("skipped", {}).items()]
    return out + ([r["note"]] if "note" in r else []) + [""]


def checkpoint(r: dict[str, Any]) -> list[str]:
    out = ["## Checkpoint from device tensors", ""] + _failed("the checkpoint", r)
    if "torch_save_s" not in r:
        return out
    out += [f"{_gib(r['bytes'])} in {r['tensors']} tensors on {r['device']}, to {r['target']}; "
            "seconds (steady: median of the saves after the first)", "",
            "| arm | training blocked | until durable |", "|---|---:|---:|",
            f"| copy into pinned memory (floor) | {r['copy_floor_s']:.3f} | |",
            f"| mxfs.ckpt, first save | {r['first_blocked_s']:.3f} | "
            f"{r['first_durable_s']:.3f} |",
            f"| mxfs.ckpt, steady | {r['blocked_s']:.3f} | {r['durable_s']:.3f} |",
            f"| torch.save + fsync | {r['torch_save_s']:.3f} | {r['torch_save_s']:.3f} |", "",
            f"torch.save / mxfs: blocked {r['blocked_vs_torch_save']:.1f}x, durable "
            f"{r['durable_vs_torch_save']:.2f}x; restored bytes equal: mxfs "
            f"{_yes(r['equal_mxfs'])}, torch.save {_yes(r['equal_torch_save'])}", ""]
    return out


def kv(r: dict[str, Any]) -> list[str]:
    out = ["## KV chunks into device buffers", ""] + _failed("the KV part", r)
    if "median" not in r:
        return out
    out += [f"{r['chunks']} chunks of {_gib(r['chunk_bytes'])} ({_gib(r['bytes'])}) into "
            f"{r['device']}; mxfs arm: {r['mxfs_arm']}; GB/s, median of {len(r['rounds'])}",
            "", "| arm | put | get cold | get warm |", "|---|---:|---:|---:|"]
    for arm, v in r["median"].items():
        put = r["put_GBps"].get(arm)
        out.append(f"| {arm} | {'' if put is None else f'{put:.2f}'} | {v['cold']:.2f} | "
                   f"{v['warm']:.2f} |")
    out.append("")
    if "skipped" in r.get("b_mxfs_kvstore", {}):
        out.append(f"b_mxfs_kvstore skipped: {r['b_mxfs_kvstore']['skipped']}")
    out += [f"bytes equal: {', '.join(f'{k} {_yes(v)}' for k, v in r['equal'].items())}; "
            f"cold is cold: {_yes(r.get('cold_is_cold'))}; a_raw_chunks reads the "
            f"{r['raw_files']} chunk files ({_gib(r['raw_bytes'])}) into host memory", ""]
    return out


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    g = env.get("gpu", {})
    lines = [f"# GPU check: {g.get('gpu_name', '?')}, torch {g.get('torch', '?')}, "
             f"{results['seconds']:.0f} s", ""]
    lines += environment(env)
    for part, show in (("loads", loads), ("checkpoint", checkpoint), ("kv", kv)):
        if part in results:  # --parts runs some of them
            lines += show(results[part])
    lines.append("all parts ran and every byte check passed" if results["ok"] else
                 "PROBLEMS: " + "; ".join(results["problems"]))
    return "\n".join(lines)
