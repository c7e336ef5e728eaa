// The README's TypeScript snippet (sdk/js/README.md), run as it is by e2e.test.ts in a
// process of its own (configured by CPUOS_API_URL / CPUOS_API_KEY). Lines ending in
// "// test:" are not the snippet's: analysis.py must be there before it runs, and the test
// must see what came out. e2e.test.ts checks that the other lines are the README's.
import { Sandbox } from "@cpuos/sdk"
import { ANALYSIS } from "./analysis.js"  // test:
const sbx = await Sandbox.create({ template: "python", timeout: "15m" })
await sbx.files.write("/work/analysis.py", ANALYSIS)  // test:
const run = await sbx.exec("python analysis.py", { onStdout: (line) => console.log(line), timeout: "2m" })
const chart = await sbx.files.read("/work/chart.png")
const id = await sbx.pause()
console.log(JSON.stringify({ id, exitCode: run.exitCode, stderr: run.stderr, chartBytes: chart.length, chartHead: Buffer.from(chart.subarray(0, 8)).toString("hex") }))  // test:
