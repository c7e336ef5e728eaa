"""microVM backend: QEMU ``-M microvm`` (KVM) run by our own jailer.

Modules: ``jailer`` (Firecracker-style jail: chroot + pivot_root, cgroups, rlimits,
namespaces, unprivileged uid), ``qemu`` (command lines and the QMP client),
``guest_artifacts`` (guest kernel, initramfs and disk images from Debian packages, cached
under ``$CPUOS_HOME/microvm``), ``probe`` (does a guest actually boot here?) and ``backend``.
"""
