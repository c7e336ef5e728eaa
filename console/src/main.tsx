import "./nonce" // first: <style> elements made from here on carry the page's nonce
import { render } from "preact"
import { App } from "./app"
import "./style.css"

render(<App />, document.getElementById("app")!)
