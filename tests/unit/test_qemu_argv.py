"""The QEMU microvm command line (pure function): every option the design asks for."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from cpuosd.backends.microvm.qemu import (
    SANDBOX,
    VMConfig,
    clone_argv,
    kernel_cmdline,
    qemu_argv,
    support_files,
    template_boot_argv,
)

BASE = VMConfig(
    qmp_socket="/run/qmp.sock", kernel="/boot/vmlinux", initrd="/boot/initrd",
    cmdline="quiet panic=-1", vcpus=2, memory_mib=1024, rootfs_image="/disk/root.ext4",
    overlay_image="/disk/overlay.ext4", agent_socket="/agent/agent.sock")


def values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def one(argv: list[str], flag: str) -> str:
    v = values(argv, flag)
    assert len(v) == 1, f"{flag} appears {len(v)} times in {argv}"
    return v[0]


def variants() -> list[list[str]]:
    return [
        qemu_argv(BASE),
        qemu_argv(dataclasses.replace(BASE, accel="tcg")),
        qemu_argv(dataclasses.replace(BASE, tap="tap0", serial_log="/run/serial.log")),
        qemu_argv(dataclasses.replace(BASE, start_paused=True, agent_socket_server=True)),
        template_boot_argv(BASE, "/dev/shm/tpl.mem"),
        clone_argv(BASE, "/dev/shm/tpl.mem"),
    ]


def test_binary_first() -> None:
    assert qemu_argv(BASE)[0] == "qemu-system-x86_64"
    assert qemu_argv(dataclasses.replace(BASE, qemu="/usr/bin/q"))[0] == "/usr/bin/q"


def test_machine_without_legacy_devices() -> None:
    assert one(qemu_argv(BASE), "-M") == \
        "microvm,x-option-roms=off,pit=off,pic=off,rtc=off,isa-serial=off"


def test_no_defaults_no_display_no_reboot() -> None:
    argv = qemu_argv(BASE)
    for flag in ("-nodefaults", "-no-user-config", "-no-reboot"):
        assert argv.count(flag) == 1, flag
    assert one(argv, "-display") == "none"


def test_kvm_host_cpu() -> None:
    argv = qemu_argv(BASE)
    assert "-enable-kvm" in argv
    assert one(argv, "-cpu") == "host,-arch-capabilities"
    assert "-accel" not in argv


def test_tcg_variant_has_no_kvm() -> None:
    argv = qemu_argv(dataclasses.replace(BASE, accel="tcg"))
    assert "-enable-kvm" not in argv
    assert one(argv, "-accel") == "tcg"
    assert one(argv, "-cpu") == "max"
    # TCG has no kvmclock: the guest needs the PIT (and RTC) to calibrate and keep time
    assert one(argv, "-M") == "microvm,x-option-roms=off,pit=on,pic=off,rtc=on,isa-serial=off"


def test_smp_and_memory() -> None:
    argv = qemu_argv(dataclasses.replace(BASE, vcpus=3, memory_mib=768))
    assert one(argv, "-smp") == "3"
    assert one(argv, "-m") == "768"


def test_seccomp_sandbox_denies_everything_optional() -> None:
    for argv in variants():
        assert one(argv, "-sandbox") == \
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    assert SANDBOX.startswith("on,")


def test_never_daemonize() -> None:
    for argv in variants():
        assert "-daemonize" not in argv
        assert not any("daemonize" in a for a in argv)


def test_pvh_direct_boot() -> None:
    argv = qemu_argv(BASE)
    assert one(argv, "-kernel") == "/boot/vmlinux"
    assert one(argv, "-initrd") == "/boot/initrd"
    assert one(argv, "-append") == "quiet panic=-1"
    assert "-bios" not in argv


def test_virtio_mmio_devices_only() -> None:
    for argv in variants():
        for dev in values(argv, "-device"):
            kind = dev.split(",")[0]
            assert kind.endswith("-device") or kind == "virtserialport", dev
            assert "pci" not in kind
        assert "-usb" not in argv and "-vga" not in argv


def test_disks_root_readonly_and_overlay_writable() -> None:
    argv = qemu_argv(BASE)
    drives = values(argv, "-drive")
    assert drives == [
        "id=root,file=/disk/root.ext4,format=raw,if=none,readonly=on",
        "id=overlay,file=/disk/overlay.ext4,format=raw,if=none,discard=unmap",
    ]
    blk = [d for d in values(argv, "-device") if d.startswith("virtio-blk-device")]
    assert blk == ["virtio-blk-device,drive=root,serial=cpuos-root",
                   "virtio-blk-device,drive=overlay,serial=cpuos-overlay"]


def test_agent_channel_virtio_serial_on_unix_socket() -> None:
    argv = qemu_argv(BASE)
    devs = values(argv, "-device")
    assert "virtio-serial-device,max_ports=2" in devs
    assert "virtserialport,chardev=agent,name=cpuos.agent,nr=1" in devs
    assert "socket,id=agent,path=/agent/agent.sock,server=off,reconnect=1" in \
        values(argv, "-chardev")
    srv = qemu_argv(dataclasses.replace(BASE, agent_socket_server=True))
    assert "socket,id=agent,path=/agent/agent.sock,server=on,wait=off" in values(srv, "-chardev")
    none = qemu_argv(dataclasses.replace(BASE, agent_socket=None))
    assert not any("virtserialport" in d for d in values(none, "-device"))


def test_network_only_with_a_tap() -> None:
    argv = qemu_argv(BASE)
    assert "-netdev" not in argv and "-nic" not in argv and "-net" not in argv
    net = qemu_argv(dataclasses.replace(BASE, tap="tap-x1", mac="52:54:00:00:00:01"))
    assert one(net, "-netdev") == "tap,id=net0,ifname=tap-x1,script=no,downscript=no"
    assert "virtio-net-device,netdev=net0,mac=52:54:00:00:00:01" in values(net, "-device")


def test_qmp_unix_socket_server_nowait() -> None:
    assert one(qemu_argv(BASE), "-qmp") == "unix:/run/qmp.sock,server=on,wait=off"


def test_console_discarded_by_default() -> None:
    argv = qemu_argv(BASE)
    assert "-serial" not in argv
    assert not any(c.startswith("file,") for c in values(argv, "-chardev"))
    assert "-monitor" not in argv and "-chardev stdio" not in " ".join(argv)


def test_serial_log_variant() -> None:
    argv = qemu_argv(dataclasses.replace(BASE, serial_log="/run/serial.log"))
    assert one(argv, "-M").endswith(",isa-serial=on")
    assert "file,id=serial0,path=/run/serial.log" in values(argv, "-chardev")
    assert one(argv, "-serial") == "chardev:serial0"


def test_template_boot_shares_its_ram_file() -> None:
    argv = template_boot_argv(BASE, "/dev/shm/tpl.mem")
    assert one(argv, "-object") == \
        "memory-backend-file,id=mem,size=1024M,mem-path=/dev/shm/tpl.mem,share=on"
    assert one(argv, "-machine") == "memory-backend=mem"
    assert "-incoming" not in argv


def test_clone_maps_ram_private_and_waits_for_migration() -> None:
    argv = clone_argv(BASE, "/dev/shm/tpl.mem")
    assert one(argv, "-object") == \
        "memory-backend-file,id=mem,size=1024M,mem-path=/dev/shm/tpl.mem,share=off"
    assert one(argv, "-machine") == "memory-backend=mem"
    assert one(argv, "-incoming") == "defer"


def test_plain_boot_has_named_ram_and_no_incoming() -> None:
    # RAM is always the backend "mem": a clone's image (file-backed RAM) restores into it
    argv = qemu_argv(BASE)
    assert one(argv, "-object") == "memory-backend-ram,id=mem,size=1024M"
    assert one(argv, "-machine") == "memory-backend=mem"
    assert "-incoming" not in argv and "-S" not in argv
    assert "-S" in qemu_argv(dataclasses.replace(BASE, start_paused=True))


def test_commas_in_paths_are_escaped() -> None:
    argv = qemu_argv(dataclasses.replace(BASE, rootfs_image="/a,b/root.ext4",
                                         qmp_socket="/run/q,m.sock"))
    assert values(argv, "-drive")[0].startswith("id=root,file=/a,,b/root.ext4,")
    assert one(argv, "-qmp") == "unix:/run/q,,m.sock,server=on,wait=off"


def test_invalid_configs() -> None:
    with pytest.raises(ValueError):
        qemu_argv(dataclasses.replace(BASE, vcpus=0))
    with pytest.raises(ValueError):
        qemu_argv(dataclasses.replace(BASE, accel="hvf"))  # type: ignore[arg-type]


def test_kernel_cmdline() -> None:
    quiet = kernel_cmdline(extra=["cpuos.hostname=x"]).split()
    assert "quiet" in quiet and "8250.nr_uarts=0" in quiet and "panic=-1" in quiet
    assert quiet[-1] == "cpuos.hostname=x"
    assert not any(w.startswith("console=") for w in quiet)
    assert "console=ttyS0" in kernel_cmdline(console=True).split()
    assert "tsc_early_khz" not in kernel_cmdline()
    assert "tsc_early_khz=2000000" in kernel_cmdline(accel="tcg").split()


@pytest.mark.skipif(shutil.which("ldd") is None
                    or not os.path.exists("/usr/bin/qemu-system-x86_64"),
                    reason="needs qemu-system-x86_64 (apt-get install qemu-system-x86) and ldd")
def test_support_files_cover_libraries_and_firmware() -> None:
    files = dict(support_files("/usr/bin/qemu-system-x86_64", "kvm"))
    assert any(d.endswith("/libc.so.6") for d in files)
    assert any("ld-linux" in d for d in files)
    assert "/usr/share/qemu/bios-microvm.bin" in files
    assert not any("accel-tcg" in d for d in files)
    tcg = dict(support_files("/usr/bin/qemu-system-x86_64", "tcg"))
    assert any("accel-tcg-x86_64.so" in d for d in tcg)
