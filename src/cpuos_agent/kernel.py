"""The old name of ``cpuos_agent.interp_driver``, kept for template builds made before the
rename (issue 26): their info record holds the start command ``python3 -m
cpuos_agent.kernel``. Nothing imports it; it can go once every such build is rebuilt
(``cpuosd template build code-interpreter``)."""

if __name__ == "__main__":
    from cpuos_agent.interp_driver import main

    main()
