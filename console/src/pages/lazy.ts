// The pages loaded after the first one (a chunk of their own, with uPlot).
export { SandboxPage } from "./sandbox"
export { TemplatesPage } from "./templates"
export { UsagePage } from "./usage"
export { WorkspacePage } from "./workspace"
