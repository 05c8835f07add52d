from forge_load.app import main

raise SystemExit(main())
